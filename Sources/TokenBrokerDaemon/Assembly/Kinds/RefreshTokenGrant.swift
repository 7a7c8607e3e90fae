import TokenBrokerCore
import Upstream

/// `Grant=refresh_token`: a refresh token obtained by a login (`Login`, the device flow),
/// rotated at each refresh. Waits signed out until someone logs in.
struct RefreshTokenGrant: OAuthSessionKind {
    let settings: SessionConfiguration.OAuthSettings

    func source(for session: SessionConfiguration, in factory: SessionFactory) -> (source: any TokenSource, upstream: HTTPTokenSource?) {
        let http = factory.httpSource(session, settings, grant: .refreshToken)
        return (http, http)
    }

    var logsInAtStart: Bool { false }

    var interactiveLogin: InteractiveLoginOffer { .offered(settings) }
}
