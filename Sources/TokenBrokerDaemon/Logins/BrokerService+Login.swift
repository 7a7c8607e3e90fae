import Basics
import BrokerContract
import TokenBrokerCore
import Upstream
import Varlink

/// The interactive logins: the device grant (`DeviceLogin`), the authorization code grant with
/// PKCE (`CodeLogin`, `CompleteCodeLogin`), and which of them suits a session (`LoginFlow`).
/// Both end the same way (`finishLogin`): a login installs its token only in the session it
/// began in — not after a reload pointed the session elsewhere, nor after a logout or another
/// login (the generation it began in is the one it must find).
extension BrokerService {
    func deviceLogin(_ session: SessionTable.Session, by peer: PeerCredentials) throws(BrokerError) -> VarlinkHandling {
        let name = session.configuration.name
        guard let upstream = session.upstream else { throw .loginFailed(session: name, reason: "this session has no OAuth upstream") }
        try claimLogin(name)
        logger.notice("device login of session \(name) started by \(peer)", session: name)
        return .async { [self] sink in
            await deviceLogin(session, upstream, sink)
            interactiveLogins.release(name)
        }
    }

    /// The client of a login, and the new generation's DPoP key for a DPoP session: made
    /// first, so that the grant's token request proves it and the tokens are bound to it.
    private func loginClient(_ upstream: HTTPTokenSource) async throws(FetchFailure) -> (OAuthClient, Secret?) {
        let proofKey = try upstream.newProofKey()
        return (try await upstream.client(proofKey: proofKey), proofKey)
    }

    /// A login that failed, said in the journal: the error its caller gets.
    private func loginFailure(_ name: String, _ flow: String, _ reason: String) -> BrokerError {
        logger.warning("\(flow) of session \(name) failed: \(reason)", session: name)
        return .loginFailed(session: name, reason: reason)
    }

    /// The session's one interactive login slot (device or code), or why not.
    private func claimLogin(_ name: String) throws(BrokerError) {
        switch interactiveLogins.claim(name) {
        case .claimed: return
        case .busy:
            throw .loginFailed(session: name, reason: "a login of this session is under way already (finish it, or wait for it to end)")
        case .full: throw .loginFailed(session: name, reason: "\(InteractiveLogins.mostAtOnce) interactive logins are under way already")
        }
    }

    /// DeviceLogin: start the device grant, tell the caller where to approve it, poll, and log
    /// the session in with what it yields. The caller disconnecting stops the polling, but a
    /// poll under way runs to its answer: it may carry the tokens of a login the user
    /// approved, which the server gives only once (so the polling runs in the upstream pool,
    /// which the daemon drains at its stop).
    private func deviceLogin(_ session: SessionTable.Session, _ upstream: HTTPTokenSource, _ sink: VarlinkReplySink) async {
        let name = session.configuration.name
        func failed(_ reason: String) { sink.send(loginFailure(name, "device login", reason).reply) }
        let began = await session.coordinator.status().generation
        let client: OAuthClient
        let proofKey: Secret?
        do {
            (client, proofKey) = try await loginClient(upstream)
        } catch {
            return failed(error.message)
        }
        let authorization: DeviceAuthorization
        do {
            authorization = try await client.startDeviceAuthorization()
        } catch {
            return failed(error.description)
        }
        let prompt = DeviceLoginEvent.prompt(verificationUri: authorization.verificationURI, userCode: authorization.userCode,
                                             expiresIn: Int64(authorization.expiresIn.seconds),
                                             verificationUriComplete: authorization.verificationURIComplete)
        sink.send(VarlinkReply(parameters: prompt.parameters, continues: true))
        let abandoned = SynchronizedBox(false)
        let polled: Result<FetchedToken, DeviceLoginError> = await withTaskCancellationHandler {
            await outliving.outliving({ () -> Result<FetchedToken, DeviceLoginError> in
                do throws(DeviceLoginError) {
                    return .success(try await client.completeDeviceLogin(authorization, clock: ContinuousClock(), stop: { abandoned.value }))
                } catch {
                    return .failure(error)
                }
            }, refused: .failure(.failed(.transient("the daemon is stopping"))))
        } onCancel: {
            abandoned.value = true
        }
        let token: FetchedToken
        switch polled {
        case let .success(fetched): token = fetched
        case let .failure(error):
            if abandoned.value { return }
            return failed(error.description)
        }
        switch await finishLogin(name, "device login", upstream, client, token, proofKey: proofKey, began: began) {
        case let .success(generation): sink.send(VarlinkReply(parameters: DeviceLoginEvent.done(LoginReply(generation: generation)).parameters))
        case let .failure(error): sink.send(error.reply)
        }
    }

    func codeLogin(_ session: SessionTable.Session, by peer: PeerCredentials, tellingRefusals: Bool = false) throws(BrokerError) -> VarlinkHandling {
        let name = session.configuration.name
        guard let upstream = session.upstream, case let .oauth(settings) = session.configuration.upstream else {
            throw .loginFailed(session: name, reason: "this session has no OAuth upstream")
        }
        guard settings.grant == .refreshToken else {
            throw .loginFailed(session: name, reason: "a Grant=client_credentials session needs no login")
        }
        try claimLogin(name)
        logger.notice("code login of session \(name) started by \(peer)", session: name)
        return .async { [self] sink in
            await codeLogin(session, upstream, settings, sink, tellingRefusals: tellingRefusals)
            interactiveLogins.release(name)
        }
    }

    /// CodeLogin: find the authorization endpoint, open the redirect listener, tell the caller
    /// where to send the browser, wait for the redirect (from the listener or pasted), redeem
    /// the code once, check the ID token, and log the session in. The caller disconnecting, or
    /// `LoginTimeout=` passing, abandons the login; the listener closes when it ends. Each
    /// request the listener refuses goes to the journal (bounded) and, with `tellingRefusals`,
    /// to the caller as a `refused` event: a user whose server sends an unusable redirect is not
    /// left waiting for `LoginTimeout=` with a message only the browser saw.
    private func codeLogin(_ session: SessionTable.Session, _ upstream: HTTPTokenSource, _ settings: SessionConfiguration.OAuthSettings,
                           _ sink: VarlinkReplySink, tellingRefusals: Bool) async {
        let name = session.configuration.name
        let logger = self.logger
        func failed(_ reason: String) { sink.send(loginFailure(name, "code login", reason).reply) }
        let began = await session.coordinator.status().generation
        let client: OAuthClient
        let proofKey: Secret?
        let server: HTTPTokenSource.CodeLoginServer
        do {
            server = try await upstream.codeLoginServer()
            (client, proofKey) = try await loginClient(upstream)
        } catch {
            return failed(error.message)
        }
        guard let listener = RedirectListener.open(ports: settings.login.redirectPorts, requestTimeout: settings.client.timeout) else {
            let ports = settings.login.redirectPorts.map(String.init).joined(separator: " ")
            return failed("no port of LoginRedirectPorts= (\(ports)) is free on 127.0.0.1")
        }
        // The browser's page is sent before the listener closes.
        defer { listener.drain() }
        let request = AuthorizationRequest(redirectURI: "http://127.0.0.1:\(listener.port)\(RedirectListener.path)", issuer: server.issuer,
                                           issuerRequired: server.issuerInRedirect)
        let login = CodeLogin(session: name, request: request)
        let host = "127.0.0.1:\(listener.port)"
        listener.start(route: { head, _ in RedirectListener.route(head, login, host: host) }, refused: { _ in })
        interactiveLogins.publish(login)
        let scope = settings.client.scope
        let prompt = CodeLoginEvent.prompt(authorizationUri: request.url(authorizationEndpoint: server.authorizationEndpoint, clientID: settings.client.clientID,
                                                                         scope: scope),
                                           redirectUri: request.redirectURI, expiresIn: Int64(settings.login.timeout.seconds))
        sink.send(VarlinkReply(parameters: prompt.parameters, continues: true))
        logger.info("code login of session \(name) waits for its redirect at \(request.redirectURI)", session: name)

        let result = await withTaskGroup(of: Void.self) { group in
            // (Ends with the login: `finish` ends the refusals.)
            group.addTask {
                for await reason in login.refusals {
                    logger.limited(.notice, key: "login-refused:\(name)", "code login of session \(name): the redirect listener refused a request: \(reason)")
                    if tellingRefusals { sink.send(VarlinkReply(parameters: CodeLoginEvent.refused(reason: reason).parameters, continues: true)) }
                }
            }
            let result = await redeem(login, within: settings.login.timeout, name, upstream, client, settings, proofKey: proofKey, began: began)
            login.finish(result)
            return result
        }
        if Task.isCancelled { return }
        switch result {
        case let .success(generation): sink.send(VarlinkReply(parameters: CodeLoginEvent.done(LoginReply(generation: generation)).parameters))
        case let .failure(error): sink.send(error.reply)
        }
    }

    /// The code login's answer, redeemed and installed; what the login ends with.
    private func redeem(_ login: CodeLogin, within timeout: Duration, _ name: String, _ upstream: HTTPTokenSource, _ client: OAuthClient,
                        _ settings: SessionConfiguration.OAuthSettings, proofKey: Secret?, began: Int) async -> Result<Int, BrokerError> {
        func failed(_ reason: String) -> Result<Int, BrokerError> { .failure(loginFailure(name, "code login", reason)) }
        switch await login.answer(within: timeout) {
        case nil:
            if Task.isCancelled { return failed("the login was abandoned (its caller went away, or the daemon is stopping)") }
            return failed("no redirect came within \(Int(timeout.seconds)) s (LoginTimeout=): log in again")
        case let .denied(error, description)?:
            return failed("the authorization server refused: \(error)" + (description.map { " (\($0))" } ?? ""))
        case let .code(code)?:
            // Once a code is taken, its redemption runs to its end whatever becomes of the
            // caller (cancelled, the request would spend the code and lose what the server
            // issued, unrevoked): in the upstream pool, which the daemon drains at its stop.
            return await outliving.outliving({ [self] in
                await redeem(code, login, name, upstream, client, settings, proofKey: proofKey, began: began)
            }, refused: failed("the daemon is stopping, or too many upstream requests wait"))
        }
    }

    /// Redeems the code, checks the ID token, and installs the tokens.
    private func redeem(_ code: Secret, _ login: CodeLogin, _ name: String, _ upstream: HTTPTokenSource, _ client: OAuthClient,
                        _ settings: SessionConfiguration.OAuthSettings, proofKey: Secret?, began: Int) async -> Result<Int, BrokerError> {
        func failed(_ reason: String) -> Result<Int, BrokerError> { .failure(loginFailure(name, "code login", reason)) }
        let token: FetchedToken
        do {
            token = try await client.redeem(code: code, request: login.request)
        } catch {
            return failed("the code was not redeemed: \(error.message)")
        }
        // An ID token must be this login's (its nonce); one is required when the scope asked
        // for it (`openid`).
        let openID = settings.client.scope?.split(separator: " ").contains("openid") == true
        if let problem = login.request.idTokenProblem(in: token, clientID: settings.client.clientID, issuer: settings.issuer, required: openID) {
            revokeInBackground(token, client, name, because: "its ID token was refused")
            return failed(problem)
        }
        return await finishLogin(name, "code login", upstream, client, token, proofKey: proofKey, began: began)
    }

    /// CompleteCodeLogin: the pasted redirect, offered to the session's waiting login.
    func completeCodeLogin(_ name: String, redirect: String, by peer: PeerCredentials) -> VarlinkHandling {
        .async { [self] sink in
            guard let login = interactiveLogins.waiting(name) else {
                sink.send(BrokerError.loginFailed(session: name, reason: "no code login of this session is waiting for its redirect "
                                                  + "(start one with `tokenbroker ctl login \(name) --flow=code`; it may have ended)").reply)
                return
            }
            switch login.offer(redirect) {
            case let .invalid(reason, _):
                logger.notice("a redirect pasted by \(peer) for the code login of session \(name) was refused: \(reason)", session: name)
                sink.send(BrokerError.loginFailed(session: name, reason: "\(reason); the login is still waiting").reply)
            case .closed:
                sink.send(BrokerError.loginFailed(session: name, reason: "the login has its answer already, or has ended").reply)
            case .taken:
                logger.notice("the code login of session \(name) was answered by a redirect pasted by \(peer)", session: name)
                switch await login.result() {
                case let .success(generation)?: sink.send(VarlinkReply(parameters: LoginReply(generation: generation).parameters))
                case let .failure(error)?: sink.send(error.reply)
                case nil: return   // (the caller went away)
                }
            }
        }
    }

    /// LoginFlow: `LoginFlow=`, else the device flow when the server has a device
    /// authorization endpoint (configured or discovered), else the code flow.
    func loginFlow(_ session: SessionTable.Session) throws(BrokerError) -> VarlinkHandling {
        let name = session.configuration.name
        guard let upstream = session.upstream, case let .oauth(settings) = session.configuration.upstream else {
            throw .loginFailed(session: name, reason: "this session has no OAuth upstream")
        }
        switch settings.login.flow {
        case .device: return .reply(VarlinkReply(parameters: LoginFlowReply(flow: .device, reason: "LoginFlow=device").parameters))
        case .code: return .reply(VarlinkReply(parameters: LoginFlowReply(flow: .code, reason: "LoginFlow=code").parameters))
        case .auto:
            let source = settings.issuer == nil ? "configured" : "configured or in its metadata"
            return .async { sink in
                do throws(FetchFailure) {
                    let endpoints = try await upstream.endpoints()
                    let chosen = endpoints.deviceAuthorization != nil
                        ? LoginFlowReply(flow: .device, reason: "LoginFlow=auto, and the server has a device authorization endpoint (\(source))")
                        : LoginFlowReply(flow: .code, reason: "LoginFlow=auto, and the server has no device authorization endpoint (\(source))")
                    sink.send(VarlinkReply(parameters: chosen.parameters))
                } catch {
                    sink.send(BrokerError.loginFailed(session: name, reason: error.message).reply)
                }
            }
        }
    }

    /// Installs an interactive login's token in the session as the table holds it now, if it
    /// is still the one the login began in: the same upstream (no reload rebuilt it) and the
    /// generation `began` (no logout or other login since). Otherwise, or when the login cannot
    /// be stored, the token's refresh token is revoked.
    private func finishLogin(_ name: String, _ flow: String, _ upstream: HTTPTokenSource, _ client: OAuthClient, _ token: FetchedToken,
                             proofKey: Secret?, began: Int) async -> Result<Int, BrokerError> {
        let logger = self.logger
        if token.refreshToken == nil {
            logger.warning("\(flow) of session \(name): the server gave no refresh token, so the session ends when this access token expires",
                           session: name)
        }
        let result: Result<Int, BrokerError>
        do {
            let reply = try await boundary(name) { session in
                // A reload may have pointed the session at another server meanwhile: a token of
                // this one must not be installed there.
                guard session.upstream === upstream else {
                    return BrokerError.loginFailed(session: name, reason: "the session was reconfigured during the login; log in again").reply
                }
                let generation = try await session.coordinator.login(refreshToken: token.refreshToken, proofKey: proofKey, initial: token,
                                                                     expecting: began)
                logger.log(.notice, "\(flow) of session \(name) done: generation \(generation)", session: name, generation: generation)
                return VarlinkReply(parameters: LoginReply(generation: generation).parameters)
            }
            result = BrokerError(reply, session: name).map { .failure($0) } ?? .success(LoginReply(reply.parameters).generation)
        } catch {
            result = .failure(contractError(error, session: name))
        }
        // Not installed (reconfigured, superseded, removed by a reload, not stored): what the
        // login got is revoked.
        if case let .failure(error) = result {
            let reason = if case let .loginFailed(_, reason) = error { reason } else { error.name }
            logger.warning("\(flow) of session \(name) failed: \(reason)", session: name)
            revokeInBackground(token, client, name, because: "the login was not installed (\(reason))")
        }
        return result
    }

    /// Revokes what a refused login got (RFC 7009), in the background: its refresh token, or
    /// its access token when it brought none.
    private func revokeInBackground(_ token: FetchedToken, _ client: OAuthClient, _ name: String, because reason: String) {
        let (credential, hint, kind) = token.refreshToken.map { ($0, "refresh_token", "refresh token") }
            ?? (token.accessToken, "access_token", "access token")
        let logger = self.logger
        let started = outliving.enqueue {
            do throws(FetchFailure) {
                let revoked = try await client.revoke(credential, hint: hint)
                logger.notice("session \(name): a login's \(kind) " + (revoked ? "is revoked" : "stays valid upstream (no revocation endpoint)")
                              + ": \(reason)", session: name)
            } catch {
                logger.warning("session \(name): a login's \(kind) was not revoked (\(error.message)): \(reason)", session: name)
            }
        }
        if !started {
            logger.warning("session \(name): a refused login's \(kind) is not revoked upstream: the daemon is stopping, "
                           + "or \(outliving.backlogLimit) tasks are waiting already", session: name)
        }
    }
}
