import Varlink

/// The `io.tokenbroker.Broker` interface: the text of `io.tokenbroker.Broker.varlink`, embedded
/// byte for byte at build time; `GetInterfaceDescription` returns exactly this.
public enum BrokerInterface {
    public static let name = "io.tokenbroker.Broker"
    public static let text = String(decoding: PackageResources.io_tokenbroker_Broker_varlink, as: UTF8.self)
    public static let interface = VarlinkInterface(description: text)

    /// Fully qualified error names.
    enum Error {
        static let noSuchSession = "io.tokenbroker.Broker.NoSuchSession"
        static let signedOut = "io.tokenbroker.Broker.SignedOut"
        static let permissionDenied = "io.tokenbroker.Broker.PermissionDenied"
        static let refreshFailed = "io.tokenbroker.Broker.RefreshFailed"
        static let throttled = "io.tokenbroker.Broker.Throttled"
        static let storeFailed = "io.tokenbroker.Broker.StoreFailed"
        static let configurationError = "io.tokenbroker.Broker.ConfigurationError"
        static let loginFailed = "io.tokenbroker.Broker.LoginFailed"
        static let sessionConfigured = "io.tokenbroker.Broker.SessionConfigured"
        static let shuttingDown = "io.tokenbroker.Broker.ShuttingDown"
        static let internalError = "io.tokenbroker.Broker.InternalError"
        static let protocolError = "io.tokenbroker.Broker.ProtocolError"
    }
}
