#if canImport(Glibc)
import Glibc
#endif
import DevIssuer
import DPoP
import TokenBrokerCore
import TokenBrokerDaemon
import Upstream

/// `tokenbroker serve --dev`: the development issuer in this process, and a configuration with
/// two sessions that use it and are logged in at start: `demo` (bearer tokens) and `demo-dpop`
/// (`DPoP=yes`: tokens bound to a key the daemon holds); and `demo-read`, derived from `demo`
/// (its tokens exchanged for ones with the audience `https://read.demo.test` and scope `read`).
public struct DevelopmentSetup: DevelopmentEnvironment {
    static let session = "demo"
    static let dpopSession = "demo-dpop"
    static let derivedSession = "demo-read"
    static let keySession = "demo-key"
    static let clientID = "tokenbroker"
    static let clientSecret = "dev-secret"
    /// demo-key's client: no secret, a key (private_key_jwt) registered with the issuer.
    static let keyClientID = "tokenbroker-key"

    let issuer: DevIssuer
    /// demo-key's signing key, made at each start (its JWKS registered with the issuer).
    let clientKey: SigningKey

    public init() throws {
        var options = DevIssuer.Options()
        options.clients = [Self.clientID: Self.clientSecret]
        clientKey = try SigningKey(for: .es256)
        options.clientKeys = [Self.keyClientID: [clientKey.publicJWK(algorithm: .es256)]]
        options.deviceInterval = .seconds(2)
        // Bearer tokens without a proof, DPoP-bound ones with one.
        options.dpop = .accepted
        issuer = try DevIssuer(options: options)
    }

    public var configuration: BrokerConfiguration {
        var configuration = BrokerConfiguration()
        configuration.socketMode = 0o660
        var oauth = SessionConfiguration.OAuthSettings(client: SessionConfiguration.OAuthClientSettings())
        oauth.issuer = issuer.baseURL
        oauth.client.clientID = Self.clientID
        oauth.client.clientSecret = Secret(Self.clientSecret)
        var dpop = oauth
        dpop.dpop = .on
        configuration.sessions = [oauth, dpop].enumerated().map { index, oauth in
            SessionConfiguration(name: index == 0 ? Self.session : Self.dpopSession, upstream: .oauth(oauth), allowUsers: [], allowGroups: [],
                                 policy: RefreshPolicy(), origin: "--dev")
        }
        // demo serves the development server (Serves=http://127.0.0.1:PORT), so the credential
        // helpers can be tried against it.
        configuration.sessions[0].settings.serves = ServedURL(served).map { [$0] } ?? []
        let derived = SessionConfiguration.DerivedSettings(parent: Self.session, method: .exchange, audiences: ["https://read.demo.test"],
                                                           resources: [], scope: "read", oauth: oauth)
        configuration.sessions.append(SessionConfiguration(name: Self.derivedSession, upstream: .derived(derived), allowUsers: [], allowGroups: [],
                                                           policy: RefreshPolicy(), origin: "--dev"))
        // demo-key: no secret anywhere; each token request carries an assertion signed with a key
        // (as ClientKeyFile= gives one), checked by the issuer against the JWKS registered for it.
        var keyed = SessionConfiguration.OAuthSettings(client: SessionConfiguration.OAuthClientSettings())
        keyed.issuer = issuer.baseURL
        keyed.grant = .clientCredentials
        keyed.client.clientID = Self.keyClientID
        keyed.client.authentication = .privateKeyJWT
        keyed.client.clientKey = Secret(clientKey.privatePEM)
        configuration.sessions.append(SessionConfiguration(name: Self.keySession, upstream: .oauth(keyed), allowUsers: [], allowGroups: [],
                                                           policy: RefreshPolicy(), origin: "--dev"))
        return configuration
    }

    /// Logs both in with refresh tokens fresh from the issuer (the DPoP session's is bound to
    /// its key by its first refresh, which proves the key).
    public var sessionNames: [String] { [Self.session, Self.dpopSession] }

    public func logIn(_ coordinator: RefreshCoordinator<ContinuousClock>, proofKey: Secret?) async {
        _ = try? await coordinator.login(refreshToken: Secret(issuer.issueRefreshToken(clientID: Self.clientID)), proofKey: proofKey)
    }

    /// The command users type: `tokenbroker` beside this executable (a build directory, where
    /// `tokenbroker-daemon` is what runs now), else the installed one on `PATH`.
    static var command: String {
        guard let executable = CommandLine.arguments.first, let slash = executable.lastIndex(of: "/") else { return "tokenbroker" }
        let sibling = String(executable[...slash]) + "tokenbroker"
        return access(sibling, X_OK) == 0 ? sibling : "tokenbroker"
    }

    /// What demo serves to the credential helpers: the development server's origin.
    var served: String { "http://" + (issuer.baseURL.split(separator: "/", omittingEmptySubsequences: true).dropFirst().first.map(String.init) ?? "") }

    /// What to try next, printed at start: the README's short form, after one `export`.
    public func guide(socket: String) -> String {
        let command = Self.command
        let directory = command.contains("/") ? String(command[..<command.lastIndex(of: "/")!]) : nil
        let export = (directory.map { "PATH=\($0):$PATH " } ?? "") + "TOKENBROKER_SOCKET=\(socket)"
        return """
            tokenbroker is running in development mode.
              issuer   \(issuer.baseURL)  (development OAuth server, in this process)
              socket   \(socket)
              sessions demo (logged in; serves \(served) to the credential helpers),
                       demo-dpop (logged in, DPoP: tokens bound to a key held here),
                       demo-read (derived from demo: its token exchanged for audience https://read.demo.test, scope read),
                       demo-key (no client secret: private_key_jwt, its key's JWKS registered with the issuer)

            Try, in another shell:
              export \(export)
              tokenbroker ctl token demo
              tokenbroker ctl token demo-read     (a narrower token than demo's; signed out with demo)
              tokenbroker ctl token demo-key      (its client authenticates with a signed JWT, not a secret)
              tokenbroker ctl client-key demo-key     (the JWKS a server registers for it)
              tokenbroker ctl status
              curl -H "Authorization: Bearer $(tokenbroker ctl token demo)" \(issuer.resourceURL)
              curl -H @<(tokenbroker ctl proof demo-dpop GET \(issuer.resourceURL)) \(issuer.resourceURL)
              printf 'url=\(issuer.resourceURL)\\n\\n' | tokenbroker credential git get     (git's helper: demo's token)
              tokenbroker ctl logout demo && tokenbroker ctl login demo     (device flow: open the printed URL)
              tokenbroker ctl login demo --flow=code     (authorization code + PKCE: open the printed URL, or paste where it lands)

            Stop with Ctrl-C.

            """
    }

    public func stop() { issuer.stop() }
}
