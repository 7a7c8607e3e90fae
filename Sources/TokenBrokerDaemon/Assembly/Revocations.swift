import Basics
import TokenBrokerCore
import Upstream

/// Refresh tokens nobody will use, revoked upstream, best effort: a discarded answer's in the
/// factory's pool of work that outlives its caller (bounded, awaited at stop: when it is full or the daemon
/// stops, the revocation is skipped, and said), an abandoned request's in the request's own task.
extension SessionFactory {
    /// What happens to an upstream answer that arrived after a logout (or login) had ended its
    /// generation: its refresh token is revoked, like the one the logout retired.
    func discardedTokenRevocation(_ session: SessionConfiguration, _ upstream: (any UpstreamAccount)?) -> @Sendable (FetchedToken) -> Void {
        guard let upstream, Self.kind(of: session).revokesAtLogout else { return { _ in } }
        let (logger, tasks, name) = (self.logger, outliving, session.name)
        return { fetched in
            guard let refreshToken = fetched.refreshToken else { return }
            let started = tasks.enqueue {
                if case let .failed(problem) = await upstream.revoke(refreshToken) {
                    logger.warning("revoking the refresh token of a discarded answer of session \(name) failed: \(problem)", session: name)
                }
            }
            if !started { Self.skipped(logger, name, tasks) }
        }
    }

    /// What happens to a token request whose flight a logout, login or stop ended before the
    /// issuer answered (`nil`: it is cut off, as nothing would be revoked): it goes on to its
    /// deadline, and a refresh token it brings (the issuer rotated already) is revoked, in the
    /// request's own task, so that the logout leaves nothing usable upstream. What cannot be
    /// revoked is said.
    ///
    /// `fleetGeneration`: a fleet session's, read when the answer comes. A holder's request goes
    /// on no longer than its flight lease allows (`FetchRequest.timeLimit`), so that no broker
    /// taking over can overlap it, and what it brings is revoked only when a logout or login
    /// (here, or followed from elsewhere) has ended its generation, and only a rotated refresh
    /// token. One that comes after the holder gave up for want of time is not: its generation
    /// goes on, the fleet may still use its predecessor (an issuer with a reuse grace period),
    /// and revoking could end that grant too.
    func abandonedRequestRevocation(_ session: SessionConfiguration, _ upstream: any UpstreamAccount, fleetGeneration: (@Sendable () -> Int)? = nil)
        -> (@Sendable (FetchRequest, Result<FetchedToken, any Error>) async -> Void)? {
        guard Self.kind(of: session).revokesAtLogout else { return nil }
        let (logger, name) = (self.logger, session.name)
        return { request, result in
            if let fleetGeneration, fleetGeneration() == request.generation {
                // The holder gave up for want of time, and the issuer rotated after all: the fleet
                // holds a spent refresh token, and its next refresh ends the session.
                if case let .success(fetched) = result, fetched.refreshToken.map({ $0 != request.refreshToken }) ?? false {
                    logger.log(.warning, "session \(name): a refresh answer came after this broker had given up on it for its flight lease; "
                               + "the issuer rotated the refresh token, so the next refresh may fail (log in again then)",
                               session: name, generation: request.generation)
                }
                return
            }
            switch result {
            case let .success(fetched):
                guard let refreshToken = fetched.refreshToken, fleetGeneration == nil || refreshToken != request.refreshToken else { return }
                switch await upstream.revoke(refreshToken) {
                case .revoked:
                    logger.log(.info, "session \(name): a refresh answer that came after the logout (or login) had ended its request "
                               + "brought a new refresh token; it is revoked upstream", session: name, generation: request.generation)
                case .noEndpoint:
                    logger.log(.warning, "session \(name): a refresh answer that came after the logout brought a new refresh token, "
                               + "and there is no revocation endpoint: it stays valid upstream", session: name, generation: request.generation)
                case let .failed(problem):
                    logger.log(.warning, "session \(name): revoking the refresh token that came after the logout failed (\(problem)): "
                               + "it stays valid upstream", session: name, generation: request.generation)
                }
            case let .failure(error):
                // No answer: if the issuer rotated, the new refresh token is known to nobody and
                // cannot be revoked here; the logout revoked the one it knew.
                guard let failure = error as? FetchFailure, case .transient = failure.kind, request.refreshToken != nil else { return }
                logger.log(.notice, "session \(name): the refresh under way at the logout got no answer (\(failure.reason)): if the issuer "
                           + "rotated the refresh token, the new one cannot be revoked from here", session: name, generation: request.generation)
            }
        }
    }

    private static func skipped(_ logger: Logger, _ name: String, _ tasks: TaskPool) {
        logger.limited(.warning, key: "revocation-skipped",
                       "session \(name): a refresh token nobody will use is not revoked upstream: the daemon is stopping, "
                       + "or \(tasks.backlogLimit) tasks are waiting already")
    }
}
