import TokenBrokerCore
import Upstream

/// `Grant=jwt-bearer` (RFC 7523 §2.1): the JWT a platform keeps in a file (`AssertionFile=`: a
/// Kubernetes service-account token, a CI OIDC token) is the grant itself. No refresh token and
/// no login: it starts logged in, and each refresh presents the file's JWT as it is then. A file
/// that is missing, unreadable, malformed or expired, or a JWT the server refuses, is a
/// transient failure, tried again with backoff: the platform renews the file, the session
/// carries on.
struct JWTBearerGrant: OAuthSessionKind {
    let settings: SessionConfiguration.OAuthSettings

    var grant: JWTBearerRequest {
        JWTBearerRequest(assertion: AssertionFile(path: settings.grantAssertionFile ?? "", role: "assertion"), scope: settings.client.scope)
    }

    var logsInAtStart: Bool { true }

    var interactiveLogin: InteractiveLoginOffer { .none("a Grant=jwt-bearer session needs no login: its grant is AssertionFile='s JWT") }
}
