import Fleet
import TokenBrokerCore
import Upstream

/// `DerivedFrom=`: another session's tokens, narrowed to audiences, resources (RFC 8707) and a
/// scope, at the parent's server: by RFC 8693 token exchange of the parent's current access
/// token (`Derivation=exchange`), or by the parent's refresh token with `resource` and `scope`
/// in the parent's one lineage (`Derivation=refresh`, RFC 8707 §2.2). Its own cached token, flight, backoff and refresh guard; its parent's boundaries
/// (`DerivedSessions`): logged in while the parent is, signed out with it.
struct DerivedSession: SessionKind {
    let settings: SessionConfiguration.DerivedSettings

    func source(for session: SessionConfiguration, in factory: SessionFactory) -> (source: any TokenSource, account: (any UpstreamAccount)?) {
        switch settings.method {
        case .exchange:
            let grant = TokenExchangeRequest(audiences: settings.audiences, resources: settings.resources, scope: settings.scope,
                                             subjectToken: factory.currentToken(of: settings.parent))
            let http = factory.httpSource(session, settings.oauth, grant: grant)
            return (http, http)
        case .refresh:
            let http = factory.httpSource(session, settings.oauth, grant: RefreshTokenRequest(resources: settings.resources, scope: settings.scope))
            return (factory.lineage(of: settings.parent, via: http, scope: settings.scope), http)
        }
    }

    /// It logs in when its parent is logged in (`DerivedSessions.reconcile`), not on its own.
    var logsInAtStart: Bool { false }

    var ownClient: Result<SessionConfiguration.OAuthSettings, OwnClientRefusal> {
        .failure(OwnClientRefusal(reason: "a derived session authenticates as its parent: ask for session \(settings.parent)"))
    }

    var interactiveLogin: InteractiveLoginOffer {
        .none("a derived session logs in with its parent: log in to \(settings.parent)")
    }

    /// Its tokens carry no refresh token of their own (an exchange's is dropped). Nothing is
    /// revoked with the parent's client on its behalf: at some servers that ends the parent's
    /// grant; its tokens end with the parent's at servers that tie them to it.
    var revokesAtLogout: Bool { false }

    /// The parent's refresh (the exchange needs a current subject token; a refresh derivation
    /// waits for the parent's flight under way), then its own request.
    var longestFlight: Duration {
        settings.oauth.client.timeout * 2 + (settings.oauth.issuer.map(Discovery.longest(for:)) ?? .zero) * 2
    }

    var parent: String? { settings.parent }

    func wayBackIn(_ session: String) -> String? { "tokenbroker ctl login \(settings.parent)" }

    func fleetRefusal(_ fleet: FleetSettings) -> String? {
        "Fleet=yes cannot be used on a derived session (it follows its parent on this host: share the parent with the fleet instead)"
    }
}
