import TokenBrokerCore
import Upstream

/// `Grant=client_credentials`: each refresh is a new grant request with the client's own
/// credentials; no refresh token. Needs no login: it starts logged in.
struct ClientCredentialsGrant: OAuthSessionKind {
    let settings: SessionConfiguration.OAuthSettings

    var grant: ClientCredentialsRequest { .clientCredentials }

    var logsInAtStart: Bool { true }

    var interactiveLogin: InteractiveLoginOffer { .none("a Grant=client_credentials session needs no login") }
}
