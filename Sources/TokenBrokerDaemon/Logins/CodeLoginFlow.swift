import Basics
import BrokerContract
import TokenBrokerCore
import Upstream

/// The authorization code grant with PKCE (RFC 7636) as a login of a session: the daemon's
/// loopback listener for the browser's redirect (RFC 8252), or the redirect pasted.
extension BrokerService {
    /// CodeLogin: find the authorization endpoint, open the redirect listener, tell the caller
    /// where to send the browser, wait for the redirect (from the listener or pasted), redeem
    /// the code once, check the ID token, and log the session in. The caller disconnecting, or
    /// `LoginTimeout=` passing, abandons the login; the listener closes when it ends. Each
    /// request the listener refuses goes to the journal (bounded) and, with `tellingRefusals`,
    /// to `refused`: a user whose server sends an unusable redirect is not
    /// left waiting for `LoginTimeout=` with a message only the browser saw.
    func runCodeLogin(_ session: SessionTable.Session, _ upstream: any UpstreamAccount, _ settings: SessionConfiguration.OAuthSettings,
                      prompt: (CodeLoginEvent) -> Void, refused: @escaping @Sendable (String) -> Void) async -> LoginOutcome {
        let name = session.configuration.name
        let logger = self.logger
        func failed(_ reason: String) -> LoginOutcome { .failed(loginFailure(name, "code login", reason)) }
        let began = await session.coordinator.status().generation
        let client: OAuthClient
        let proofKey: Secret?
        let server: CodeLoginServer
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
        let event = CodeLoginEvent.prompt(authorizationUri: request.url(authorizationEndpoint: server.authorizationEndpoint, clientID: settings.client.clientID,
                                                                         scope: scope, resources: settings.client.loginResources),
                                           redirectUri: request.redirectURI, expiresIn: Int64(settings.login.timeout.seconds))
        prompt(event)
        logger.info("code login of session \(name) waits for its redirect at \(request.redirectURI)", session: name)

        let result = await withTaskGroup(of: Void.self) { group in
            // (Ends with the login: `finish` ends the refusals.)
            group.addTask {
                for await reason in login.refusals {
                    logger.limited(.notice, key: "login-refused:\(name)", "code login of session \(name): the redirect listener refused a request: \(reason)")
                    refused(reason)
                }
            }
            let result = await redeem(login, within: settings.login.timeout, name, upstream, client, settings, proofKey: proofKey, began: began)
            login.finish(result)
            return result
        }
        return Task.isCancelled ? .abandoned : LoginOutcome(result)
    }

    /// The code login's answer, redeemed and installed; what the login ends with.
    private func redeem(_ login: CodeLogin, within timeout: Duration, _ name: String, _ upstream: any UpstreamAccount, _ client: OAuthClient,
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
    private func redeem(_ code: Secret, _ login: CodeLogin, _ name: String, _ upstream: any UpstreamAccount, _ client: OAuthClient,
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
        return await install(name, "code login", upstream, client, token, proofKey: proofKey, began: began)
    }
}
