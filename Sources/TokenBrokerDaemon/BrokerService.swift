import Basics
import DPoP
import BrokerContract
import Fleet
import Synchronization
import SQLiteStore
import TokenBrokerCore
import Upstream
import Varlink

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

    let metrics: Metrics
    /// The metrics exposition (the Metrics method).
    let metricsText: @Sendable () async -> String
    /// Work that outlives its caller (a logout's revocation, a device login's polling, a code's
    /// redemption): the daemon's pool, awaited at stop.
    let outliving: TaskPool
    /// The interactive logins under way, one per session (code logins waiting for their redirects among them).
    let interactiveLogins = InteractiveLogins()
    /// The delegations' sockets and what each may do.
    let delegations: Delegations
    /// Who was handed which token.
    let audit: Audit
    /// The client keys the daemon holds (`private_key_jwt`).
    let clientKeys: ClientKeys?

    init(sessions: SessionTable, logger: Logger, reload: @escaping @Sendable () async -> String?,
         forget: @escaping @Sendable (String) async throws -> Bool = { _ in false }, metrics: Metrics = Metrics(version: "test"),
         metricsText: @escaping @Sendable () async -> String = { "" }, outliving: TaskPool = TaskPool(limit: 256, backlog: 1 << 16),
         delegations: Delegations? = nil, audit: Audit? = nil, clientKeys: ClientKeys? = nil) {
        self.clientKeys = clientKeys
        self.audit = audit ?? Audit(write: { [logger] fields, line in logger.audit(fields, line: line) })
        self.outliving = outliving
        self.delegations = delegations ?? Delegations(logger: logger)
        self.sessions = sessions
        self.logger = logger
        self.reload = reload
        self.forget = forget
        self.metrics = metrics
        self.metricsText = metricsText
    }

    // MARK: - The method table

    /// Who may call a method.
    enum Access: Sendable {
        /// The session's users (`AllowUsers=`/`AllowGroups=`) and admins.
        case sessionUser
        /// Admins only.
        case admin
        /// Anyone who may connect (what they see is filtered).
        case anyone
    }

    /// One method: who may call it, whether it streams (needs `more`), and its handler. (A class:
    /// every call takes one from the table, and a reference is one retain where a struct with a
    /// closure inside an enum was copied field by field.)
    final class Method: Sendable {
        typealias Session = SessionTable.Session
        /// A handler of a method on one configured session (resolved and checked by the
        /// dispatcher), or of one that names none (or, Forget, an unconfigured one).
        enum Handler: Sendable {
            case session(@Sendable (BrokerService, BrokerRequest, PeerCredentials, Session) throws -> VarlinkHandling)
            case other(@Sendable (BrokerService, BrokerRequest, PeerCredentials) throws -> VarlinkHandling)
        }

        let access: Access
        let streams: Bool
        let handler: Handler

        init(access: Access, streams: Bool = false, handler: Handler) {
            (self.access, self.streams, self.handler) = (access, streams, handler)
        }
    }

    static let methods: [BrokerMethod: Method] = [
        .getToken: Method(access: .sessionUser, handler: .session { service, request, peer, session in
            guard case let .getToken(_, minValid, key) = request else { throw BrokerError.internalError }
            return try service.keyed(session, key, by: peer) { service.getToken($0, key, validFor: minValid, by: peer) }
        }),
        .recover: Method(access: .sessionUser, handler: .session { service, request, peer, session in
            guard case let .recover(_, rejected, key) = request else { throw BrokerError.internalError }
            return try service.keyed(session, key, by: peer) { service.recover($0, key, rejected: Secret(rejected), by: peer) }
        }),
        .watch: Method(access: .sessionUser, streams: true, handler: .session { service, _, peer, session in
            .async { sink in await service.watch(session, peer, sink) }
        }),
        .logout: Method(access: .admin, handler: .session { service, _, peer, session in service.logout(session.configuration.name, by: peer) }),
        .login: Method(access: .admin, handler: .session { service, request, peer, session in
            guard case let .login(_, refreshToken) = request else { throw BrokerError.internalError }
            return service.login(session.configuration.name, Secret(refreshToken), by: peer)
        }),
        .refresh: Method(access: .admin, handler: .session { service, _, peer, session in service.refresh(session, by: peer) }),
        .deviceLogin: Method(access: .admin, streams: true, handler: .session { service, _, peer, session in
            try service.deviceLogin(session, by: peer)
        }),
        .codeLogin: Method(access: .admin, streams: true, handler: .session { service, request, peer, session in
            guard case let .codeLogin(_, refusals) = request else { throw BrokerError.internalError }
            return try service.codeLogin(session, by: peer, tellingRefusals: refusals)
        }),
        .completeCodeLogin: Method(access: .admin, handler: .session { service, request, peer, session in
            guard case let .completeCodeLogin(_, redirect) = request else { throw BrokerError.internalError }
            return service.completeCodeLogin(session.configuration.name, redirect: redirect, by: peer)
        }),
        .loginFlow: Method(access: .admin, handler: .session { service, _, _, session in try service.loginFlow(session) }),
        .status: Method(access: .anyone, handler: .other { service, _, peer in service.status(for: peer) }),
        .forget: Method(access: .admin, handler: .other { service, request, peer in try service.forget(request.session ?? "", by: peer) }),
        .reload: Method(access: .admin, handler: .other { service, _, peer in service.reload(by: peer) }),
        .credential: Method(access: .anyone, handler: .other { service, request, peer in
            guard case let .credential(url, rejected, minValid, key) = request else { throw BrokerError.internalError }
            return service.credential(url, rejected: rejected.map(Secret.init), validFor: minValid, key: key, for: peer)
        }),
        .getProof: Method(access: .sessionUser, handler: .session { service, request, peer, session in
            guard case let .getProof(_, method, uri, nonce, rejected, minValid, key) = request else { throw BrokerError.internalError }
            return try service.keyed(session, key, by: peer) {
                service.getProof($0, key, method: method, uri: uri, nonce: nonce, rejected: rejected.map(Secret.init), validFor: minValid, by: peer)
            }
        }),
        .resetFleetHistory: Method(access: .admin, handler: .session { service, _, peer, session in
            service.resetFleetHistory(session.configuration.name, by: peer)
        }),
        .metrics: Method(access: .admin, handler: .other { service, _, _ in
            .async { sink in sink.send(VarlinkReply(parameters: MetricsReply(text: await service.metricsText()).parameters)) }
        }),
        .delegate: Method(access: .admin, handler: .other { service, request, peer in
            guard case let .delegate(delegation) = request else { throw BrokerError.internalError }
            return service.delegate(delegation, by: peer)
        }),
        .delegations: Method(access: .admin, handler: .other { service, _, _ in
            .reply(VarlinkReply(parameters: ["delegations": .array(service.delegations.infos.map { .object($0.parameters) })]))
        }),
        .audit: Method(access: .admin, handler: .other { service, request, _ in
            guard case let .audit(session, limit) = request else { throw BrokerError.internalError }
            let records = service.audit.recent(limit: limit ?? 50, session: session).map(AuditEntry.init)
            return .reply(VarlinkReply(parameters: ["records": .array(records.map { .object($0.parameters) })]))
        }),
        .clientKey: Method(access: .admin, handler: .session { service, request, peer, session in
            guard case let .clientKey(_, change) = request else { throw BrokerError.internalError }
            return try service.clientKey(session, change, by: peer)
        }),
        .undelegate: Method(access: .admin, handler: .other { service, request, peer in
            guard case let .undelegate(name) = request else { throw BrokerError.internalError }
            return service.undelegate(name, by: peer)
        }),
    ]

    /// `methods` by `BrokerMethod.ordinal`.
    static let methodsByOrdinal: [Method?] = BrokerMethod.allCases.map { methods[$0] }

    /// What a delegation's socket answers: the token methods, for its sessions only.
    static let delegable: Set<BrokerMethod> = [.getToken, .recover, .getProof, .watch, .credential, .status]

    /// Decodes the call once, checks who may make it, resolves the session it names, and hands
    /// it to its method; refusals and bad parameters are answered here.
    func handle(_ call: VarlinkCall, from peer: PeerCredentials) -> VarlinkHandling {
        // The method's name is read once, here.
        let name = BrokerMethod(member: call.member)
        let handling = dispatch(name, call, from: peer)
        // Token calls are counted by result; the hot path is one relaxed increment.
        guard let method = name, Metrics.tokenMethods.contains(method) else { return handling }
        switch handling {
        case let .reply(reply):
            if reply.error == nil, method == .getToken { metrics.getTokenOK.add() } else { metrics.call(method, error: reply.error) }
            return handling
        case let .async(body):
            let metrics = self.metrics
            return .async { sink in
                let answered = Atomic<Bool>(false)
                await body(VarlinkReplySink { reply in
                    // (The server finishes its own sink when the task returns.)
                    guard let reply else { return }
                    if !reply.continues, !answered.exchange(true, ordering: .relaxed) { metrics.call(method, error: reply.error) }
                    sink.send(reply)
                })
                // The caller went away first: its task was cancelled, and nothing was sent.
                if !answered.load(ordering: .relaxed) { metrics.call(method, error: "cancelled") }
            }
        }
    }

    private func dispatch(_ name: BrokerMethod?, _ call: VarlinkCall, from peer: PeerCredentials) -> VarlinkHandling {
        guard let name, let method = Self.methodsByOrdinal[name.ordinal] else {
            return .reply(.error(VarlinkServiceError.methodNotImplemented, ["method": .string(call.method)]))
        }
        if peer.listener != 0 { return delegatedDispatch(name, method, call, from: peer) }
        do {
            // Who may call comes first, from the session's name alone: a caller who may not
            // use the session learns nothing from the rest of its parameters.
            let named = call.parameters["session"]?.stringValue
            var session: SessionTable.Session?
            switch method.access {
            case .sessionUser:
                if let named { session = try use(named, peer) }
            case .admin:
                guard sessions.isAdmin(peer) else { throw BrokerError.permissionDenied }
                // Forget names a session that is not configured (any more).
                if let named, name != .forget {
                    guard let found = sessions.snapshot.sessions[named] else { throw BrokerError.noSuchSession(session: named) }
                    session = found
                }
            case .anyone:
                break
            }
            let request = try BrokerRequest(name, call.parameters)
            if method.streams && !call.more { return .reply(.error(VarlinkServiceError.expectedMore)) }
            switch method.handler {
            case let .session(handler):
                // Decoding required the name the session was resolved from.
                guard let session else { throw BrokerError.internalError }
                return try handler(self, request, peer, session)
            case let .other(handler):
                return try handler(self, request, peer)
            }
        } catch let error as ParameterError {
            return .reply(error.reply)
        } catch {
            if case BrokerError.permissionDenied = error {
                logger.limited(.warning, key: "denied:\(peer.uid)", "permission denied: \(call.method) by \(peer)")
            }
            return .reply(reply(for: error, session: ""))
        }
    }

    /// A call through a delegation's socket: the delegation is the principal. Only its token
    /// methods answer, for its sessions only, whoever the peer is — no admin method, no other
    /// session (refused as one the peer may not use), no key (refused as on a session that
    /// allows none) — and only for the peers it admits.
    private func delegatedDispatch(_ name: BrokerMethod, _ method: Method, _ call: VarlinkCall, from peer: PeerCredentials) -> VarlinkHandling {
        do {
            // (One look at the table for the whole call.)
            let snapshot = sessions.snapshot
            guard let grant = delegations.grant(forListener: peer.listener), Self.delegable.contains(name),
                  grant.admits(peer, overflowUID: snapshot.access.overflowUID, overflowGID: snapshot.access.overflowGID) else {
                logger.limited(.warning, key: "delegated-denied:\(peer.listener)", "permission denied: \(call.method) by \(peer) through a delegation")
                throw BrokerError.permissionDenied
            }
            var session: SessionTable.Session?
            if let named = call.parameters["session"]?.stringValue {
                guard grant.sessions.contains(named), let found = snapshot.sessions[named] else {
                    logger.limited(.warning, key: "delegated-denied:\(peer.listener)", "permission denied: \(call.method) by \(peer) (a session it does not serve)")
                    throw BrokerError.permissionDenied
                }
                session = found
            }
            let request = try BrokerRequest(name, call.parameters)
            switch request {
            case .getToken(_, _, let key?), .recover(_, _, let key?), .getProof(_, _, _, _, _, _, let key?), .credential(_, _, _, let key?):
                throw ParameterError(name: key.resource != nil ? "resource" : "scope")
            case .status:
                return status(for: peer, within: grant.sessions)
            case let .credential(url, rejected, minValid, _):
                return credential(url, rejected: rejected.map(Secret.init), validFor: minValid, key: nil, for: peer, within: grant.sessions)
            default:
                break
            }
            if method.streams && !call.more { return .reply(.error(VarlinkServiceError.expectedMore)) }
            guard case let .session(handler) = method.handler, let session else { throw BrokerError.permissionDenied }
            return try handler(self, request, peer, session)
        } catch let error as ParameterError {
            return .reply(error.reply)
        } catch {
            return .reply(reply(for: error, session: ""))
        }
    }

    /// Delegate: the sessions on a socket of their own, or one session's token in a file kept
    /// fresh, or both, from now until `ttl`, `Undelegate` or the daemon's stop.
    private func delegate(_ request: DelegationRequest, by peer: PeerCredentials) -> VarlinkHandling {
        let name = request.name ?? "delegation-" + String(UInt32.random(in: 0...UInt32.max), radix: 16)
        let snapshot = sessions.snapshot
        if let unknown = request.sessions.first(where: { snapshot.sessions[$0] == nil }) {
            return .reply(BrokerError.noSuchSession(session: unknown).reply)
        }
        if let socket = request.socket, let problem = DelegationConfiguration.socketProblem(socket) {
            return .reply(BrokerError.delegationFailed(name: name, reason: "socket: \(problem)").reply)
        }
        var delegation = DelegationConfiguration(name: name)
        (delegation.sessions, delegation.socket) = (request.sessions, request.socket ?? "")
        (delegation.socketUser, delegation.socketGroup, delegation.socketMode) = (request.user, request.group, request.mode ?? 0o660)
        (delegation.allowUsers, delegation.allowGroups) = (request.allowUsers, request.allowGroups)
        delegation.maxConnections = request.maxConnections ?? delegation.maxConnections
        delegation.expiresAt = request.ttl.map { UTCTime.unixSeconds() + $0 }
        if let path = request.file, let session = request.sessions.first {
            if let problem = TokenFileConfiguration.pathProblem(path) {
                return .reply(BrokerError.delegationFailed(name: name, reason: "file: \(problem)").reply)
            }
            if snapshot.sessions[session]?.configuration.settings.oauth.dpop != .off {
                return .reply(BrokerError.delegationFailed(name: name, reason: "file: session \(session) has DPoP tokens, bound to the broker's "
                                                           + "key: a file cannot carry their proofs").reply)
            }
            if request.readers.count > TokenFileConfiguration.mostReaders {
                return .reply(BrokerError.delegationFailed(name: name, reason: "file: more than \(TokenFileConfiguration.mostReaders) readers").reply)
            }
            var file = TokenFileConfiguration(name: name)
            (file.session, file.path, file.format) = (session, path, request.format ?? .token)
            (file.user, file.group, file.mode, file.readers) = (request.user, request.group, request.fileMode ?? 0o600, request.readers)
            file.expiresAt = delegation.expiresAt
            delegation.file = file
        }
        let (delegations, logger, made) = (self.delegations, self.logger, delegation)
        return .async { sink in
            do {
                let grant = try await delegations.add(made, configured: false)
                logger.notice("delegation \(name) made by \(peer)")
                var reply: JSONObject = ["name": .string(grant.name)]
                if let expiresAt = grant.configuration.expiresAt { reply["expiresAt"] = .int(expiresAt) }
                sink.send(VarlinkReply(parameters: reply))
            } catch {
                sink.send(BrokerError.delegationFailed(name: name, reason: "\(error)").reply)
            }
        }
    }

    /// Undelegate: the socket removed and its connections closed, its file erased, before the
    /// reply. (A configured one — a `[Delegation]` or an `[Output]` — until the next reload.)
    private func undelegate(_ name: String, by peer: PeerCredentials) -> VarlinkHandling {
        let (delegations, logger) = (self.delegations, self.logger)
        return .async { sink in
            guard await delegations.remove(name) else {
                guard let files = delegations.files, files.all.contains(where: { $0.configured && $0.configuration.name == name }),
                      await files.remove(name) else {
                    sink.send(BrokerError.noSuchDelegation(name: name).reply)
                    return
                }
                logger.notice("output \(name) ended by \(peer): its file is erased")
                sink.send(VarlinkReply())
                return
            }
            logger.notice("delegation \(name) ended by \(peer)")
            sink.send(VarlinkReply())
        }
    }

    /// The session `peer` may use. A peer that may not use it learns nothing more: whether it
    /// exists or not, the answer is `PermissionDenied` (only admins, who see every session
    /// anyway, are told `NoSuchSession`), so session names cannot be probed.
    private func use(_ name: String, _ peer: PeerCredentials) throws(BrokerError) -> SessionTable.Session {
        guard let (session, allowed) = sessions.lookup(name, for: peer) else {
            throw sessions.isAdmin(peer) ? .noSuchSession(session: name) : .permissionDenied
        }
        guard allowed else { throw .permissionDenied }
        return session
    }

    // MARK: - The methods

    /// `body` on the session, or, with `key`, on the session of that key (made at its first
    /// call). A key the session does not allow is refused as one no session has: InvalidParameter
    /// naming what it narrows. A signed-out session makes no key. (A key that exists was made
    /// in the session's current generation: every boundary drops them all.)
    private func keyed(_ session: SessionTable.Session, _ key: TokenKey?, by peer: PeerCredentials,
                       _ body: (SessionTable.Session) -> VarlinkHandling) throws -> VarlinkHandling {
        body(try keyedSession(session, key, by: peer))
    }

    /// The session of `key` on `session` (`session` itself without one), as `keyed`; a key
    /// made now is charged to `peer`'s uid.
    private func keyedSession(_ session: SessionTable.Session, _ key: TokenKey?, by peer: PeerCredentials) throws -> SessionTable.Session {
        guard let key else { return session }
        if let keyed = session.keys?.existing(key) { return keyed }
        guard let keys = session.keys else { throw ParameterError(name: key.resource != nil ? "resource" : "scope") }
        if let parameter = keys.refusal(key) { throw ParameterError(name: parameter) }
        guard session.coordinator.summary.state == .active else {
            throw contractError(SessionError.signedOut, session: session.configuration.name)
        }
        switch keys.session(for: key, by: peer.uid) {
        case let .session(keyed): return keyed
        case let .throttled(retryAfter): throw contractError(SessionError.throttled(retryAfter: retryAfter), session: session.configuration.name)
        }
    }

    /// GetToken: a fresh token inline, from the coordinator's snapshot; otherwise wait for it.
    /// With `minValid`, fresh means valid that long too (else the session's one refresh, charged
    /// to `peer` when this call starts it).
    private func getToken(_ session: SessionTable.Session, _ key: TokenKey?, validFor minValid: Int64?, by peer: PeerCredentials) -> VarlinkHandling {
        if let token = Self.freshToken(session, validFor: minValid) {
            handed(token, of: session, key, to: peer, by: .getToken)
            return .reply(session.replies.reply(for: token, Self.tokenReply))
        }
        if minValid == nil { session.replies.clear() }
        return asyncReply(session.configuration.name) { [self] in
            let token = try await Self.token(session, validFor: minValid, by: peer)
            handed(token, of: session, key, to: peer, by: .getToken)
            return Self.tokenReply(token)
        }
    }

    /// Tells the audit trail that `token` is going to `peer`.
    private func handed(_ token: IssuedToken, of session: SessionTable.Session, _ key: TokenKey?, to peer: PeerCredentials, by method: BrokerMethod) {
        audit.handed(token, of: session.configuration.name, issuer: session.auditID, key: key, to: peer, by: method,
                     delegation: peer.listener == 0 ? nil : self.delegations.grant(forListener: peer.listener)?.name ?? "#\(peer.listener)")
    }

    /// The coordinator's fresh token, valid for `minValid` seconds more when that is given.
    private static func freshToken(_ session: SessionTable.Session, validFor minValid: Int64?) -> IssuedToken? {
        guard let minValid else { return session.coordinator.freshToken() }
        return session.coordinator.freshToken(validFor: .seconds(minValid))
    }

    /// The session's token (or, with `rejected`, Recover's), valid for `minValid` more if given.
    private static func token(_ session: SessionTable.Session, rejected: Secret? = nil, validFor minValid: Int64?,
                              by peer: PeerCredentials) async throws -> IssuedToken {
        if let rejected { return try await session.coordinator.recover(rejected: rejected, by: peer.demander) }
        guard let minValid else { return try await session.coordinator.token() }
        return try await session.coordinator.token(validFor: .seconds(minValid), by: peer.demander)
    }

    /// GetProof: the token as GetToken (or, with `rejected`, Recover) has it, with a proof for
    /// the one request signed by the session's key. A fresh token is answered inline like
    /// GetToken's (one signature, tens of microseconds); the key is opened once per generation.
    private func getProof(_ session: SessionTable.Session, _ key: TokenKey?, method: String, uri: String, nonce: String?, rejected: Secret?,
                          validFor minValid: Int64?, by peer: PeerCredentials) -> VarlinkHandling {
        let name = session.configuration.name
        // The same URLs for every session, bearer or not: those a proof can name.
        guard let target = DPoPProof.target(uri) else { return .reply(ParameterError(name: "uri").reply) }
        let answer: @Sendable (IssuedToken) throws -> VarlinkReply = { [self] token in
            handed(token, of: session, key, to: peer, by: .getProof)
            // The token's reply as GetToken's (encoded once per token), and the proof appended:
            // ProofReply's members.
            let cached = session.replies.entry(for: token, Self.tokenReply)
            // (A DPoP=auto session whose server does not bind has a key, and bearer tokens.)
            guard let kept = token.proofKey, token.tokenType == "DPoP" else { return cached.reply }
            guard let upstream = session.account else { throw BrokerError.internalError }
            let proof: String
            do {
                proof = try DPoPProof.make(key: try upstream.proofKey(kept), method: method, url: uri, target: target, issuedAt: UTCTime.unixSeconds(),
                                           nonce: nonce, accessToken: token.token.reveal, accessTokenHash: cached.proofHash)
            } catch let error as FetchFailure {
                throw BrokerError.refreshFailed(session: name, reason: error.reason, retryable: false, retryAfter: nil)
            } catch {
                // (The method and URL were checked: libcrypto failed. Logged as internal.)
                throw BrokerError.internalError
            }
            return cached.reply.appending("proof", string: proof)
        }
        if rejected == nil, let token = Self.freshToken(session, validFor: minValid) {
            do { return .reply(try answer(token)) } catch let error as ParameterError { return .reply(error.reply) } catch {
                return .reply(reply(for: error, session: name))
            }
        }
        return .async { [self] sink in
            do {
                let token = try await Self.token(session, rejected: rejected, validFor: minValid, by: peer)
                sink.send(try answer(token))
            } catch is CancellationError {
                // The client is gone; nobody to answer.
            } catch let error as ParameterError {
                sink.send(error.reply)
            } catch {
                sink.send(reply(for: error, session: name))
            }
        }
    }

    /// Recover: a refresh it starts is charged to `peer`, which alone is throttled once it spent
    /// its share (`RefreshBudget`).
    private func recover(_ session: SessionTable.Session, _ key: TokenKey?, rejected: Secret, by peer: PeerCredentials) -> VarlinkHandling {
        asyncReply(session.configuration.name) { [self] in
            let token = try await session.coordinator.recover(rejected: rejected, by: peer.demander)
            handed(token, of: session, key, to: peer, by: .recover)
            return Self.tokenReply(token)
        }
    }

    /// Credential: the token of the session that serves `url` for `peer`, as GetToken (or, with
    /// `rejected`, Recover) answers it, with the session's name. No session: NoSuchSession with
    /// no name, the same for a URL nobody serves and one only another user's session serves.
    ///
    /// Answered inline on the I/O thread, as GetToken, when it costs about as much: at most
    /// `inlineCandidates` entries serve the URL's host and the session's token is fresh (a
    /// credential helper is a process per call, and a hop to a task and back was a tenth of
    /// it). Otherwise resolved in a task: a host thousands of sessions serve costs the caller
    /// its scan, and nobody else.
    private func credential(_ url: String, rejected: Secret?, validFor minValid: Int64?, key: TokenKey?, for peer: PeerCredentials,
                            within delegated: Set<String>? = nil) -> VarlinkHandling {
        let sessions = self.sessions
        // A URL that is not one names no session (the same answer the task would send).
        guard let served = ServedURL(url) else { return .reply(BrokerError.noSuchSession(session: "").reply) }
        let found = sessions.serving(served, for: peer, within: delegated, most: Self.inlineCandidates)
        if !found.tooMany {
            guard let session = found.session else { return .reply(BrokerError.noSuchSession(session: "").reply) }
            return credential(from: session, rejected: rejected, validFor: minValid, key: key, for: peer)
        }
        return .async { [self] sink in
            guard let session = sessions.serving(served, for: peer, within: delegated) else {
                sink.send(BrokerError.noSuchSession(session: "").reply)
                return
            }
            switch credential(from: session, rejected: rejected, validFor: minValid, key: key, for: peer) {
            case let .reply(reply): sink.send(reply)
            case let .async(body): await body(sink)
            }
        }
    }

    /// Entries for one host that a Credential call looks through on the I/O thread, at most.
    static let inlineCandidates = 16

    /// Credential once `session` serves the URL: on its key's session (as GetToken's on it), a
    /// fresh token at once, else (or with `rejected`, as Recover) in a task.
    private func credential(from session: SessionTable.Session, rejected: Secret?, validFor minValid: Int64?, key: TokenKey?,
                            for peer: PeerCredentials) -> VarlinkHandling {
        let name = session.configuration.name
        let keyed: SessionTable.Session
        do { keyed = try keyedSession(session, key, by: peer) } catch let error as ParameterError {
            return .reply(error.reply)
        } catch {
            return .reply(reply(for: error, session: name))
        }
        let answer = { @Sendable [self] (token: IssuedToken) -> VarlinkReply in
            handed(token, of: keyed, key, to: peer, by: .credential)
            return VarlinkReply(parameters: CredentialReply(session: name, token: TokenReply(token)).parameters)
        }
        if rejected == nil, let token = Self.freshToken(keyed, validFor: minValid) { return .reply(answer(token)) }
        return asyncReply(name) { answer(try await Self.token(keyed, rejected: rejected, validFor: minValid, by: peer)) }
    }

    private func logout(_ name: String, by peer: PeerCredentials) -> VarlinkHandling {
        let logger = self.logger
        return asyncReply(name) { [self] in
            try await boundary(name) { session in
                try await session.coordinator.logout(handingOver: revocation(for: session))
                // The encoded answer of the last token goes with it (it was served no more anyway).
                session.replies.clear()
                logger.log(.notice, "logout of session \(name) by \(peer)", session: name, generation: await session.coordinator.status().generation)
                return VarlinkReply()
            }
        }
    }

    private func login(_ name: String, _ refreshToken: Secret, by peer: PeerCredentials) -> VarlinkHandling {
        let logger = self.logger
        return asyncReply(name) { [self] in
            try await boundary(name) { session in
                if let parent = session.kind.parent {
                    throw BrokerError.loginFailed(session: name, reason: "a derived session logs in with its parent: log in to \(parent)")
                }
                // A DPoP session's new generation gets a new key (the old one ends with its generation).
                let proofKey: Secret?
                do throws(FetchFailure) { proofKey = try session.account?.newProofKey() } catch {
                    throw BrokerError.loginFailed(session: name, reason: error.message)
                }
                let generation = try await session.coordinator.login(refreshToken: refreshToken, proofKey: proofKey)
                logger.log(.notice, "login of session \(name) by \(peer)", session: name, generation: generation)
                return VarlinkReply(parameters: LoginReply(generation: generation).parameters)
            }
        }
    }

    private func refresh(_ session: SessionTable.Session, by peer: PeerCredentials) -> VarlinkHandling {
        logger.notice("forced refresh of session \(session.configuration.name) by \(peer)", session: session.configuration.name)
        return asyncReply(session.configuration.name) {
            let token = try await session.coordinator.refresh(by: peer.demander)
            return VarlinkReply(parameters: RefreshReply(generation: token.generation, tokenSerial: token.serial, expiresAt: token.expiresAt).parameters)
        }
    }

    /// Status: the sessions `peer` may use, and, for admins, the stored ones no longer configured.
    /// (`within`: a delegation's sessions, which are those its peers see.)
    private func status(for peer: PeerCredentials, within delegated: Set<String>? = nil) -> VarlinkHandling {
        let snapshot = sessions.snapshot
        let visible = snapshot.order.compactMap { snapshot.sessions[$0] }.filter { session in
            delegated.map { $0.contains(session.configuration.name) } ?? snapshot.access.mayUse(session.configuration, peer)
        }
        let admin = snapshot.access.isAdmin(peer)
        let inert = admin ? snapshot.inert : []
        return .async { sink in
            // Each entry encoded once per change of its session (a host's thousands of idle
            // sessions cost a copy each); a fleet session's, or one in backoff (its time left
            // changes by itself), each time.
            var entries: [[UInt8]] = []
            entries.reserveCapacity(visible.count + inert.count)
            for session in visible {
                let fresh = { () -> [UInt8] in
                    var status = session.coordinator.statusSnapshot()
                    // Who is throttled: admins see every peer, others only themselves. (Only
                    // while someone is: the snapshot is then never steady, so never cached.)
                    if !admin { status.throttled.removeAll { $0 != peer.demander } }
                    // (Through a delegation, a parent it does not serve is not named.)
                    let parent = session.kind.parent.flatMap { parent in delegated.map { $0.contains(parent) } ?? true ? parent : nil }
                    return Self.statusEntry(status, fleet: session.fleet?.status, derivedFrom: parent,
                                            keys: session.keys?.counts.live).encoded
                }
                if session.fleet == nil, let version = session.coordinator.steadyStatusVersion {
                    entries.append(session.statusEntry.bytes(version: version, fresh))
                } else {
                    entries.append(fresh())
                }
            }
            entries += inert.map { Self.statusEntry($0).encoded }
            var parameters: [UInt8] = []
            parameters.reserveCapacity(entries.reduce(16) { $0 + $1.count + 1 })
            parameters += #"{"sessions":["#.utf8
            for (index, entry) in entries.enumerated() {
                if index > 0 { parameters.append(UInt8(ascii: ",")) }
                parameters += entry
            }
            parameters += "]}".utf8
            sink.send(VarlinkReply(encodedParameters: parameters))
        }
    }

    private func forget(_ name: String, by peer: PeerCredentials) throws(BrokerError) -> VarlinkHandling {
        if sessions.lookup(name, for: peer) != nil { throw .sessionConfigured(session: name) }
        return .async { [self] sink in
            // Under the gate, and checked again: a reload may configure it meanwhile.
            let answer: VarlinkReply = await sessions.gate.shared { [self] in
                guard sessions.lookup(name, for: peer) == nil else { return BrokerError.sessionConfigured(session: name).reply }
                do {
                    return try await forget(name) ? VarlinkReply() : BrokerError.noSuchSession(session: name).reply
                } catch {
                    return reply(for: error, session: name)
                }
            }
            sink.send(answer)
        }
    }

    private func reload(by peer: PeerCredentials) -> VarlinkHandling {
        logger.notice("reload requested by \(peer)")
        return .async { [reload] sink in
            if let problem = await reload() {
                sink.send(BrokerError.configurationError(reason: problem).reply)
            } else {
                sink.send(VarlinkReply())
            }
        }
    }

    /// Runs a boundary (logout, login) on the session's coordinator as the table holds it *now*,
    /// under the gate: never on one a reload is handing over (see `BoundaryGate`).
    func boundary(_ name: String, _ body: @Sendable (SessionTable.Session) async throws -> VarlinkReply) async throws -> VarlinkReply {
        try await inSession(name, body) ?? BrokerError.noSuchSession(session: name).reply
    }

    /// `body` on the session as the table holds it now, with logouts, logins and reloads held
    /// back meanwhile (the gate, shared); nil when the table has no such session.
    func inSession<T: Sendable>(_ name: String, _ body: @Sendable (SessionTable.Session) async throws -> T) async throws -> T? {
        try await sessions.gate.shared { [sessions] in
            guard let session = sessions.snapshot.sessions[name] else { return nil }
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
    /// best effort, in the background (the pool of work that outlives its caller), so the logout is not delayed.
    func revocation(for session: SessionTable.Session) -> @Sendable (Secret) -> Void {
        guard let upstream = session.account, session.kind.revokesAtLogout else { return { _ in } }
        let (logger, outliving) = (self.logger, self.outliving)
        let name = session.configuration.name
        return { refreshToken in
            let started = outliving.enqueue {
                switch await upstream.revoke(refreshToken) {
                case .revoked:
                    logger.info("session \(name): the refresh token retired by the logout is revoked upstream", session: name)
                case .noEndpoint:
                    logger.notice("session \(name): no revocation endpoint; the retired refresh token stays valid upstream", session: name)
                case let .failed(problem):
                    logger.warning("revocation at logout of session \(name) failed: \(problem)", session: name)
                }
            }
            if !started {
                logger.warning("session \(name): the refresh token retired by the logout is not revoked upstream: the daemon is stopping, "
                               + "or \(outliving.backlogLimit) tasks are waiting already", session: name)
            }
        }
    }

    /// The one place where errors become wire errors. Anything unexpected is logged (by type,
    /// never by content) and answered with `InternalError`.
    func reply(for error: any Error, session: String) -> VarlinkReply {
        contractError(error, session: session).reply
    }

    func contractError(_ error: any Error, session: String) -> BrokerError {
        switch error {
        case let error as BrokerError:
            return error
        case let error as SessionError:
            switch error {
            case .signedOut:
                // The way back in, when the session's kind knows a better one than `ctl login`.
                return .signedOut(session: session, login: sessions.snapshot.sessions[session]?.kind.wayBackIn(session))
            case let .refreshFailed(reason, retryable, retryAfter):
                return .refreshFailed(session: session, reason: reason, retryable: retryable, retryAfter: retryAfter?.seconds)
            case let .throttled(retryAfter): return .throttled(session: session, retryAfter: retryAfter.seconds)
            case let .lifetimeTooShort(lifetime, asked): return .lifetimeTooShort(session: session, lifetime: lifetime.seconds, minValid: asked.seconds)
            case let .storeFailed(reason): return .storeFailed(session: session, reason: reason)
            case .shuttingDown: return .shuttingDown
            case .superseded:
                return .loginFailed(session: session, reason: "the session was logged out or logged in again while this login waited; log in again")
            }
        case let error as StoreError:
            logger.error("state database error in session \(session): \(error)")
            return .storeFailed(session: session, reason: error.message)
        case let error as EtcdError:
            // (The fleet's state could not be written: etcd's message names no value.)
            return .storeFailed(session: session, reason: "fleet: \(error.message)")
        default:
            logger.error("internal error in session \(session): \(type(of: error))")
            return .internalError
        }
    }

    static func tokenReply(_ token: IssuedToken) -> VarlinkReply {
        VarlinkReply(parameters: TokenReply(token).parameters)
    }

    /// Watch, for as long as `peer` may use the session: a reload that takes the peer off its
    /// allow lists ends the stream with `PermissionDenied` at once, and no token is sent after
    /// such a change (each is checked against the table as it is when it goes out).
    func watch(_ session: SessionTable.Session, _ peer: PeerCredentials, _ sink: VarlinkReplySink) async {
        let name = session.configuration.name
        let sessions = self.sessions
        // (Through a delegation: while it still serves the session, which is still configured.)
        let delegations = self.delegations
        let allowed: @Sendable () -> Bool = {
            guard peer.listener != 0 else { return sessions.lookup(name, for: peer)?.allowed == true }
            let granted = delegations.grant(forListener: peer.listener)?.sessions.contains(name) ?? false
            return granted && sessions.snapshot.sessions[name] != nil
        }
        // Listen for changes first, then check: a change between the call's check and now is
        // not missed.
        let changes = sessions.changes()
        if allowed() {
            await withTaskGroup(of: Void.self) { group in
                group.addTask {
                    await Self.watch(session.coordinator, sink, while: allowed) { [self] token in handed(token, of: session, nil, to: peer, by: .watch) }
                }
                group.addTask { for await _ in changes where !allowed() { return } }
                await group.next()
                group.cancelAll()
            }
        }
        // Whichever side noticed first, the stream ends saying why (ignored after a final reply).
        if !allowed() { sink.send(BrokerError.permissionDenied.reply) }
    }

    /// Watch: the current state at once, then every event; `signedOut` ends the stream. Stops,
    /// silently, when `allowed` turns false (the caller says why).
    static func watch(_ coordinator: Coordinator, _ sink: VarlinkReplySink, while allowed: @Sendable () -> Bool = { true },
                      handing: @Sendable (IssuedToken) -> Void = { _ in }) async {
        let events = await coordinator.watch()
        if await coordinator.status().state == .active && coordinator.freshToken() == nil {
            // Active but without a usable token: fetch one, so the stream starts with it.
            _ = try? await coordinator.token()
        }
        for await event in events {
            guard allowed() else { return }
            switch event {
            case let .token(token):
                handing(token)
                sink.send(VarlinkReply(parameters: WatchEvent.token(TokenReply(token), serial: Int(token.serial)).parameters, continues: true))
            case let .signedOut(generation):
                sink.send(VarlinkReply(parameters: WatchEvent.signedOut(generation: generation).parameters))
                return
            }
        }
        if !Task.isCancelled { sink.send(BrokerError.shuttingDown.reply) }
    }

    /// A stored, unconfigured session: its stored state, no activity, marked inert.
    static func statusEntry(_ inert: InertSession) -> JSON {
        var entry = StatusEntry(name: inert.name, state: inert.state.rawValue, generation: inert.generation)
        (entry.tokenSerial, entry.expiresAt, entry.lastRefresh) = (inert.tokenSerial, inert.expiresAt, inert.lastRefresh)
        entry.inert = true
        return .object(entry.parameters)
    }

    static func statusEntry(_ status: SessionStatus, fleet: DaemonFleetSession.Status? = nil, derivedFrom: String? = nil,
                            keys: Int? = nil) -> JSON {
        var entry = StatusEntry(status)
        (entry.derivedFrom, entry.keys) = (derivedFrom, keys)
        if let fleet {
            switch fleet.health {
            case .healthy: entry.fleetHealth = "healthy"
            case .starting: entry.fleetHealth = "starting"
            case let .unavailable(why):
                entry.fleetHealth = "unavailable: \(why)"
                entry.degraded = true
            case let .untrusted(why):
                entry.fleetHealth = "untrusted: \(why)"
                entry.degraded = true
            }
            (entry.fleetGeneration, entry.fleetRevision, entry.flightHolder) = (fleet.generation, fleet.revision, fleet.flightHolder)
        }
        return .object(entry.parameters)
    }
}

extension TokenReply {
    /// The token as the contract sends it (the only place its value leaves the coordinator).
    init(_ token: IssuedToken) {
        self.init(token: token.token.reveal, tokenType: token.tokenType, expiresAt: token.expiresAt, generation: token.generation)
    }
}
