#if canImport(Glibc)
import Glibc
#endif
import DevIssuer
import TokenBrokerCore
import TokenBrokerDaemon
import Upstream

/// `tokenbroker serve --dev`: the development issuer in this process, and a configuration with
/// one session, `demo`, that uses it and is logged in at start.
public struct DevelopmentSetup: DevelopmentEnvironment {
    static let session = "demo"
    static let clientID = "tokenbroker"
    static let clientSecret = "dev-secret"

    let issuer: DevIssuer

    public init() throws {
        var options = DevIssuer.Options()
        options.clients = [Self.clientID: Self.clientSecret]
        options.deviceInterval = .seconds(2)
        issuer = try DevIssuer(options: options)
    }

    public var configuration: BrokerConfiguration {
        var configuration = BrokerConfiguration()
        configuration.socketMode = 0o660
        var oauth = SessionConfiguration.OAuthSettings(client: SessionConfiguration.OAuthClientSettings())
        oauth.issuer = issuer.baseURL
        oauth.client.clientID = Self.clientID
        oauth.client.clientSecret = Secret(Self.clientSecret)
        configuration.sessions = [SessionConfiguration(name: Self.session, upstream: .oauth(oauth), allowUsers: [], allowGroups: [],
                                                       policy: RefreshPolicy(), origin: "--dev")]
        return configuration
    }

    /// Logs `demo` in with a refresh token fresh from the issuer.
    public var sessionName: String { Self.session }

    public func logIn(_ coordinator: RefreshCoordinator<ContinuousClock>) async {
        _ = try? await coordinator.login(refreshToken: Secret(issuer.issueRefreshToken(clientID: Self.clientID)))
    }

    /// The command users type: `tokenbroker` beside this executable (a build directory, where
    /// `tokenbroker-daemon` is what runs now), else the installed one on `PATH`.
    static var command: String {
        guard let executable = CommandLine.arguments.first, let slash = executable.lastIndex(of: "/") else { return "tokenbroker" }
        let sibling = String(executable[...slash]) + "tokenbroker"
        return access(sibling, X_OK) == 0 ? sibling : "tokenbroker"
    }

    /// What to try next, printed at start.
    public func guide(socket: String) -> String {
        let ctl = "\(Self.command) ctl --socket \(socket)"
        return """
            tokenbroker is running in development mode.
              issuer   \(issuer.baseURL)  (development OAuth server, in this process)
              socket   \(socket)
              session  demo (logged in)

            Try, in another shell:
              \(ctl) token demo
              \(ctl) status
              curl -H "Authorization: Bearer $(\(ctl) token demo)" \(issuer.resourceURL)
              \(ctl) logout demo && \(ctl) login demo     (device flow: open the printed URL)

            Stop with Ctrl-C.

            """
    }

    public func stop() { issuer.stop() }
}
