import TokenBrokerCore

/// What `serve --dev` runs beside the daemon: a development authorization server and the
/// configuration that uses it. The daemon's module knows only this protocol; the development
/// issuer itself lives in `TokenBrokerDevelopment`, which only the `tokenbroker` executable
/// links (and only `--dev` starts).
public protocol DevelopmentEnvironment: Sendable {
    /// The configuration to serve instead of the configuration files.
    var configuration: BrokerConfiguration { get }
    /// The sessions that are logged in at start, and how (`proofKey`: a DPoP session's new key).
    var sessionNames: [String] { get }
    func logIn(_ coordinator: RefreshCoordinator<ContinuousClock>, proofKey: Secret?) async
    /// What to try next, printed at start.
    func guide(socket: String) -> String
    /// Stops the development server (at exit).
    func stop()
}
