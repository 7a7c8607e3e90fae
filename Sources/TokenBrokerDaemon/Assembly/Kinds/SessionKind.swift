import Fleet
import TokenBrokerCore
import Upstream

/// A kind of session, with every trait the daemon asks of one: where its tokens come from,
/// whether it logs in at start, which interactive logins it offers, whether a logout revokes
/// upstream, its longest flight, and which session it depends on. One type per upstream kind
/// and grant, each in its own file; `SessionFactory.kind(of:)` is the one place that chooses
/// among them, and the rest of the daemon asks the kind (`SessionTable.Session.kind`) rather
/// than matching the configuration's upstream.
protocol SessionKind: Sendable {
    /// The session's token source, and its account at an authorization server if it has one
    /// (for logins, revocation, discovery, DPoP keys).
    func source(for session: SessionConfiguration, in factory: SessionFactory) -> (source: any TokenSource, account: (any UpstreamAccount)?)

    /// A session with nothing stored logs in at start: its credential is the configuration.
    var logsInAtStart: Bool { get }

    /// The interactive logins (device, code) it offers: the settings they use, or why none.
    var interactiveLogin: InteractiveLoginOffer { get }

    /// Whether a logout revokes the retired refresh token upstream (`RevokeOnLogout=`).
    var revokesAtLogout: Bool { get }

    /// The longest one of its refreshes may take: discovery, when an issuer is configured,
    /// plus the token request, each under its own deadline (a stop waits for it).
    var longestFlight: Duration { get }

    /// The session it takes its tokens from, if any (none does yet): started first, stopped after.
    var parent: String? { get }

    /// The command that logs a signed-out session of this kind back in, when it is not the
    /// usual `ctl login` (a `SignedOut` error's `login`).
    func wayBackIn(_ session: String) -> String?

    /// Why it cannot be shared with the fleet `fleet` (`Fleet=yes`), or nil when it can: the
    /// configuration's cross-check.
    func fleetRefusal(_ fleet: FleetSettings) -> String?

    /// The OAuth settings of the client it authenticates as itself (its keys, `ctl
    /// client-key`), or why it has none of its own.
    var ownClient: Result<SessionConfiguration.OAuthSettings, OwnClientRefusal> { get }
}

/// Why a session has no OAuth client of its own.
struct OwnClientRefusal: Error, Sendable {
    var reason: String
}

/// What a session's interactive logins use, or why it has none.
enum InteractiveLoginOffer: Sendable {
    case offered(SessionConfiguration.OAuthSettings)
    case none(String)
}

extension SessionKind {
    var parent: String? { nil }

    var ownClient: Result<SessionConfiguration.OAuthSettings, OwnClientRefusal> { .failure(OwnClientRefusal(reason: "the session has no OAuth client")) }

    func wayBackIn(_ session: String) -> String? { nil }

    func fleetRefusal(_ fleet: FleetSettings) -> String? {
        "Fleet=yes needs an OAuth session with Grant=refresh_token (a refresh token family is what the fleet shares)"
    }
}

/// The traits the OAuth kinds share: an `HTTPTokenSource` that asks for tokens with the kind's
/// grant request (`TokenGrant`, in Upstream).
protocol OAuthSessionKind: SessionKind {
    associatedtype Grant: TokenGrant
    var settings: SessionConfiguration.OAuthSettings { get }
    var grant: Grant { get }
}

extension OAuthSessionKind {
    func source(for session: SessionConfiguration, in factory: SessionFactory) -> (source: any TokenSource, account: (any UpstreamAccount)?) {
        let http = factory.httpSource(session, settings, grant: grant)
        return (http, http)
    }

    var revokesAtLogout: Bool { settings.revokeOnLogout }
    var ownClient: Result<SessionConfiguration.OAuthSettings, OwnClientRefusal> { .success(settings) }
    var longestFlight: Duration { settings.client.timeout + (settings.issuer.map(Discovery.longest(for:)) ?? .zero) }
}
