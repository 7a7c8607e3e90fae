import TokenBrokerCore
import Upstream

/// A kind of session, with every trait the daemon asks of one: where its tokens come from,
/// whether it logs in at start, which interactive logins it offers, whether a logout revokes
/// upstream, its longest flight, and which session it depends on. One type per upstream kind
/// and grant, each in its own file; `SessionFactory.kind(of:)` is the one place that chooses
/// among them, and the rest of the daemon asks the kind (`SessionTable.Session.kind`) rather
/// than matching the configuration's upstream.
protocol SessionKind: Sendable {
    /// The session's token source, and the OAuth source behind it if there is one (for
    /// revocation, device logins, discovery).
    func source(for session: SessionConfiguration, in factory: SessionFactory) -> (source: any TokenSource, upstream: HTTPTokenSource?)

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
}

/// What a session's interactive logins use, or why it has none.
enum InteractiveLoginOffer: Sendable {
    case offered(SessionConfiguration.OAuthSettings)
    case none(String)
}

extension SessionKind {
    var parent: String? { nil }
}

/// The traits the OAuth kinds share.
protocol OAuthSessionKind: SessionKind {
    var settings: SessionConfiguration.OAuthSettings { get }
}

extension OAuthSessionKind {
    var revokesAtLogout: Bool { settings.revokeOnLogout }
    var longestFlight: Duration { settings.client.timeout + (settings.issuer.map(Discovery.longest(for:)) ?? .zero) }
}
