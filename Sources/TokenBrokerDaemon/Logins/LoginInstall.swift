import Basics
import BrokerContract
import TokenBrokerCore
import Upstream

/// What every interactive login shares: its client, its failures said once, and its end
/// (`install`): a login installs its token only in the session it began in — not after a
/// reload pointed the session elsewhere, nor after a logout or another login (the generation
/// it began in is the one it must find). What it got and cannot install is revoked.
extension BrokerService {
    /// The client of a login, and the new generation's DPoP key for a DPoP session: made
    /// first, so that the grant's token request proves it and the tokens are bound to it.
    func loginClient(_ upstream: any UpstreamAccount) async throws(FetchFailure) -> (OAuthClient, Secret?) {
        let proofKey = try upstream.newProofKey()
        return (try await upstream.client(proofKey: proofKey), proofKey)
    }

    /// A login that failed, said in the journal: the error its caller gets.
    func loginFailure(_ name: String, _ flow: String, _ reason: String) -> BrokerError {
        logger.warning("\(flow) of session \(name) failed: \(reason)", session: name)
        return .loginFailed(session: name, reason: reason)
    }

    /// What the session's interactive logins use (its kind says), or why it has none.
    func loginSettings(_ session: SessionTable.Session) throws(BrokerError) -> SessionConfiguration.OAuthSettings {
        switch session.kind.interactiveLogin {
        case let .offered(settings): return settings
        case let .none(reason): throw .loginFailed(session: session.configuration.name, reason: reason)
        }
    }

    /// The OAuth source an interactive login talks to (checked against the kind first).
    func loginUpstream(_ session: SessionTable.Session) throws(BrokerError) -> any UpstreamAccount {
        _ = try loginSettings(session)
        guard let upstream = session.account else { throw .loginFailed(session: session.configuration.name, reason: "this session has no OAuth upstream") }
        return upstream
    }

    /// The session's one interactive login slot (device or code), or why not.
    func claimLogin(_ name: String) throws(BrokerError) {
        switch interactiveLogins.claim(name) {
        case .claimed: return
        case .busy:
            throw .loginFailed(session: name, reason: "a login of this session is under way already (finish it, or wait for it to end)")
        case .full: throw .loginFailed(session: name, reason: "\(InteractiveLogins.mostAtOnce) interactive logins are under way already")
        }
    }

    /// Installs an interactive login's token in the session as the table holds it now, if it
    /// is still the one the login began in: the same upstream (no reload rebuilt it) and the
    /// generation `began` (no logout or other login since). Otherwise, or when the login cannot
    /// be stored, the token's refresh token is revoked.
    func install(_ name: String, _ flow: String, _ upstream: any UpstreamAccount, _ client: OAuthClient, _ token: FetchedToken,
                 proofKey: Secret?, began: Int) async -> Result<Int, BrokerError> {
        let logger = self.logger
        if token.refreshToken == nil {
            logger.warning("\(flow) of session \(name): the server gave no refresh token, so the session ends when this access token expires",
                           session: name)
        }
        let result: Result<Int, BrokerError>
        do {
            let installed = try await inSession(name) { session -> Result<Int, BrokerError> in
                // A reload may have pointed the session at another server meanwhile: a token of
                // this one must not be installed there.
                guard session.account === upstream else {
                    return .failure(.loginFailed(session: name, reason: "the session was reconfigured during the login; log in again"))
                }
                let generation = try await session.coordinator.login(refreshToken: token.refreshToken, proofKey: proofKey, initial: token,
                                                                     expecting: began)
                logger.log(.notice, "\(flow) of session \(name) done: generation \(generation)", session: name, generation: generation)
                return .success(generation)
            }
            result = installed ?? .failure(.noSuchSession(session: name))
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
    func revokeInBackground(_ token: FetchedToken, _ client: OAuthClient, _ name: String, because reason: String) {
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
