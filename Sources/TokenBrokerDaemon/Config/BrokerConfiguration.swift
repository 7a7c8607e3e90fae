import BrokerContract
import DPoP
import Fleet
import TokenBrokerCore
import Upstream
import HTTPTransport

/// The daemon's configuration: the `[Broker]` section and every `[Session]`.
public struct BrokerConfiguration: Sendable, Equatable {
    public static let defaultPath = "/etc/tokenbroker/tokenbroker.conf"
    public static let defaultSocket = BrokerContract.defaultSocket

    /// Where the varlink socket is bound (`Socket=`; `--socket` overrides).
    public var socketPath = defaultSocket
    /// Mode of the socket file (`SocketMode=`).
    public var socketMode: UInt32 = 0o660
    /// Group owning the socket file (`SocketGroup=`); `nil` keeps the daemon's.
    public var socketGroup: UInt32?
    /// Members may call Login, Logout and Reload and see every session (`AdminGroup=`).
    public var adminGroup: UInt32?
    /// Connections served at once (`MaxConnections=`); the last 1/32 of them (at most 128) are
    /// kept for admins.
    public var maxConnections = 4096
    /// Connections one non-admin uid may hold at once (`MaxConnectionsPerUser=`).
    public var maxConnectionsPerUser = 256
    /// Largest varlink message accepted (`MaxMessageSize=`).
    public var maxMessageSize = 64 << 10
    /// Most members in one JSON object of a message (`MaxObjectMembers=`).
    public var maxObjectMembers = 1024
    /// Audit records one peer writes to the journal per `auditInterval` (`Audit`).
    public var auditBurst = 10
    public var auditInterval: Duration = .seconds(60)
    /// Time from a message's first byte to its end (`MessageTimeout=`).
    public var messageTimeout: Duration = .seconds(10)
    /// Replies queued for all clients together (`MaxQueuedOutput=`).
    public var maxQueuedOutput = 32 << 20
    /// An operator's key for the tokens in the state database (`StateKeyCredential=` or
    /// `StateKeyFile=`), which wins over the default one (`StateKey`); read at start only.
    public var stateKey: SecretBytes?
    public var sessions: [SessionConfiguration] = []
    /// Where Prometheus scrapes `GET /metrics` (`MetricsListen=`): a loopback `host:port` or a
    /// Unix socket path; off when nil. Read at start only.
    public var metricsListen: ListenAddress?
    /// Members may read the per-session series on a Unix `MetricsListen=` (`MetricsGroup=`), as
    /// admins may. Read at start only.
    public var metricsGroup: UInt32?
    /// The bearer token a scraper presents for the per-session series
    /// (`MetricsBearerTokenFile=`, `MetricsBearerTokenCredential=`); without it, TCP serves no
    /// session names. Read at start only.
    public var metricsBearerToken: Secret?
    /// The `[Fleet]` section: how this broker reaches etcd, for sessions with `Fleet=yes`.
    public var fleet: FleetSettings?
    /// The `[Delegation]` sections, in order.
    public var delegations: [DelegationConfiguration] = []
    /// The `[Output]` sections (token files), in order.
    public var outputs: [TokenFileConfiguration] = []
    /// Unknown keys and other non-fatal findings, each at `file:line`.
    public var warnings: [ConfigError] = []

    public init() {}

    /// The session called `name` (a linear search: for tools and tests).
    public func session(named name: String) -> SessionConfiguration? {
        sessions.first { $0.name == name }
    }

    /// Equal when every key of `ConfigSchema.broker` agrees and the sessions and the fleet do.
    public static func == (lhs: BrokerConfiguration, rhs: BrokerConfiguration) -> Bool {
        ConfigSchema.broker.allSatisfy { $0.same(lhs, rhs) } && lhs.sessions == rhs.sessions && lhs.fleet == rhs.fleet
            && lhs.delegations == rhs.delegations && lhs.outputs == rhs.outputs
    }
}

/// One session: an account at an authorization server, and who may use it.
public struct SessionConfiguration: Sendable, Equatable {
    public enum Upstream: Sendable, Equatable {
        /// Tokens minted inside the daemon, for development and tests only: no network.
        case test(lifetime: Duration)
        /// An OAuth 2.0 authorization server.
        case oauth(OAuthSettings)
        /// Another session's tokens, narrowed (`DerivedFrom=`).
        case derived(DerivedSettings)
    }

    /// How a derived session gets its tokens from its parent's (`Derivation=`).
    public enum DerivationMethod: String, Sendable, Equatable {
        /// RFC 8693 token exchange, the parent's current access token as the subject token.
        case exchange
        /// The parent's refresh token with `resource` and a narrower `scope` (RFC 8707 §2.2).
        case refresh
    }

    /// A derived session: its parent, and what it narrows the parent's tokens to.
    public struct DerivedSettings: Sendable, Equatable {
        public var parent: String
        public var method: DerivationMethod
        public var audiences: [String]
        public var resources: [String]
        /// A scope within the parent's (`Scope=`; nil: the parent's own).
        public var scope: String?
        /// The parent's OAuth settings: where and how the derivation is asked for.
        public var oauth: OAuthSettings

        public init(parent: String, method: DerivationMethod, audiences: [String], resources: [String], scope: String?, oauth: OAuthSettings) {
            (self.parent, self.method, self.audiences, self.resources, self.scope, self.oauth) = (parent, method, audiences, resources, scope, oauth)
        }
    }

    /// The OAuth grant a session uses (`Grant=`); each is a session kind (`SessionFactory.kind(of:)`).
    public enum OAuthGrant: String, Sendable, Equatable {
        /// Refresh tokens, obtained by a login (device flow, code flow or `Login`), rotated on each refresh.
        case refreshToken = "refresh_token"
        /// `client_credentials`: no refresh token; each refresh is a new grant request.
        case clientCredentials = "client_credentials"
        /// RFC 7523 §2.1: a platform's JWT (`AssertionFile=`) as the grant; no refresh token,
        /// each refresh presents the file's current JWT.
        case jwtBearer = "jwt-bearer"
    }

    /// How to reach and authenticate to the authorization server.
    public struct OAuthSettings: Sendable, Equatable {
        public var grant: OAuthGrant = .refreshToken
        /// The issuer identifier, for RFC 8414 discovery (explicit endpoints win).
        public var issuer: String?
        public var tokenEndpoint: String?
        public var revocationEndpoint: String?
        public var deviceAuthorizationEndpoint: String?
        /// Where a browser is sent for a code login (RFC 6749 §3.1; else from discovery).
        public var authorizationEndpoint: String?
        /// How `ctl login` logs the session in (`LoginFlow=`, `LoginRedirectPorts=`, `LoginTimeout=`).
        public var login = InteractiveLoginSettings()
        public var client: OAuthClientSettings
        /// Revoke the refresh token at logout when a revocation endpoint is known.
        public var revokeOnLogout = true
        /// Sender-constrained tokens (RFC 9449, `DPoP=yes`, or `auto` as the server's metadata
        /// says): each login makes the session a key, kept sealed in the state, that signs a
        /// proof for every request; workers get proofs.
        public var dpop = DPoPMode.off
        /// `Grant=jwt-bearer`: the file whose JWT is the grant (`AssertionFile=`).
        public var grantAssertionFile: String?

        public init(client: OAuthClientSettings) { self.client = client }

        public var endpoints: OAuthEndpoints? {
            guard tokenEndpoint != nil || revocationEndpoint != nil || deviceAuthorizationEndpoint != nil || authorizationEndpoint != nil else {
                return nil
            }
            return OAuthEndpoints(token: tokenEndpoint ?? "", revocation: revocationEndpoint, deviceAuthorization: deviceAuthorizationEndpoint,
                                  authorization: authorizationEndpoint)
        }
    }

    /// How an interactive login runs.
    public struct InteractiveLoginSettings: Sendable, Equatable {
        /// The flow `ctl login` uses unless told: `auto` is the device flow where the server
        /// offers it, else the authorization code flow.
        public enum Flow: String, Sendable, Equatable {
            case auto, device, code
        }

        public var flow = Flow.auto
        /// The loopback ports a code login's redirect listener may take, the first free one
        /// (empty: one the kernel picks).
        public var redirectPorts: [UInt16] = []
        /// How long a code login waits for its redirect.
        public var timeout = Duration.seconds(300)

        public init() {}
    }

    /// The client part of the OAuth settings (its secret is read from a file or credential).
    public struct OAuthClientSettings: Sendable, Equatable {
        public var clientID = ""
        public var clientSecret: Secret?
        public var authentication = ClientAuthentication.basic
        public var scope: String?
        /// The resources its derived sessions by refresh narrow to (`Derivation=refresh`,
        /// `Resource=`): its logins ask for them (RFC 8707), set from the whole configuration.
        public var loginResources: [String] = []
        public var tls = TLSOptions()
        public var connectTimeout: Duration = .seconds(5)
        public var timeout: Duration = .seconds(30)
        /// `private_key_jwt` with an operator's key (`ClientKeyFile=`): its PEM, checked.
        public var clientKey: Secret?
        /// `private_key_jwt` with a platform's JWT (`ClientAssertionFile=`): its file.
        public var assertionFile: String?
        /// `ClientAssertionAudience=` as written (nil: the issuer with `Issuer=`, else the token endpoint).
        public var assertionAudience: String?
        /// `ClientAssertionAlgorithm=` (nil: auto).
        public var assertionAlgorithm: SigningKey.Algorithm?

        public init() {}

        /// What signed assertions name in `aud` (`ClientAssertionAudience=`), for a server with `issuer`.
        public func audience(issuer: String?) -> AssertionAudience {
            switch assertionAudience {
            case nil: return issuer.map { .issuer($0) } ?? .tokenEndpoint
            case "issuer"?: return issuer.map { .issuer($0) } ?? .tokenEndpoint
            case "token-endpoint"?: return .tokenEndpoint
            case "endpoint"?: return .endpoint
            case let value?: return .value(value)
            }
        }

        public var configuration: OAuthClientConfiguration {
            var configuration = OAuthClientConfiguration(clientID: clientID, clientSecret: clientSecret, authentication: authentication,
                                                         scope: scope, tls: tls, connectTimeout: connectTimeout, timeout: timeout)
            configuration.loginResources = loginResources
            return configuration
        }
    }

    /// The fields, in one immutable box. A configuration is copied whole many times in a reload
    /// (read, checked, derived, into the table and each session), and a copy of the fields was
    /// a retain for each string and array among them: copies and their releases were a fifth
    /// of a reload of 10,000 sessions. A copy of the box is one retain, and its fields are read
    /// (compared, say) in place. A change makes a new box: configurations change while the
    /// file is read, not after.
    private final class Storage: Sendable {
        let settings: SessionSettings
        let fleet: FleetSettings?
        let origin: String
        let parentOAuth: OAuthSettings?

        init(settings: SessionSettings, fleet: FleetSettings?, origin: String, parentOAuth: OAuthSettings?) {
            (self.settings, self.fleet, self.origin, self.parentOAuth) = (settings, fleet, origin, parentOAuth)
        }
    }

    private var storage: Storage

    /// The session as its keys set it (`ConfigSchema.session`).
    public var settings: SessionSettings {
        _read { yield storage.settings }
        _modify {
            var settings = storage.settings
            defer { storage = Storage(settings: settings, fleet: storage.fleet, origin: storage.origin, parentOAuth: storage.parentOAuth) }
            yield &settings
        }
    }

    /// Shared with the other brokers of a fleet through etcd (`Fleet=yes`): the `[Fleet]`
    /// settings; `nil` for a session of this host alone.
    public var fleet: FleetSettings? {
        get { storage.fleet }
        set { storage = Storage(settings: storage.settings, fleet: newValue, origin: storage.origin, parentOAuth: storage.parentOAuth) }
    }

    /// Where the section was first written, for messages.
    public var origin: String {
        get { storage.origin }
        set { storage = Storage(settings: storage.settings, fleet: storage.fleet, origin: newValue, parentOAuth: storage.parentOAuth) }
    }

    /// A derived session's parent's OAuth settings, as the configuration has them (set when
    /// the configuration is read as a whole).
    public var parentOAuth: OAuthSettings? {
        get { storage.parentOAuth }
        set { storage = Storage(settings: storage.settings, fleet: storage.fleet, origin: storage.origin, parentOAuth: newValue) }
    }

    public var name: String {
        get { settings.name }
        set { settings.name = newValue }
    }

    public var upstream: Upstream {
        get {
            if let parent = settings.derivedFrom {
                return .derived(DerivedSettings(parent: parent, method: settings.derivation, audiences: settings.audiences,
                                                resources: settings.resources, scope: settings.oauth.client.scope,
                                                oauth: parentOAuth ?? OAuthSettings(client: OAuthClientSettings())))
            }
            return settings.kind == .test ? .test(lifetime: settings.testTokenLifetime) : .oauth(settings.oauth)
        }
        set {
            settings.derivedFrom = nil
            switch newValue {
            case let .test(lifetime):
                settings.kind = .test
                settings.testTokenLifetime = lifetime
            case let .oauth(oauth):
                settings.kind = .oauth
                settings.oauth = oauth
            case let .derived(derived):
                (settings.derivedFrom, settings.derivation, settings.audiences, settings.resources) =
                    (derived.parent, derived.method, derived.audiences, derived.resources)
                settings.oauth.client.scope = derived.scope
                parentOAuth = derived.oauth
            }
        }
    }

    /// Users (uids) who may use the session (`AllowUsers=`).
    public var allowUsers: [UInt32] {
        get { settings.allowUsers }
        set { settings.allowUsers = newValue }
    }

    /// Groups whose members may use it (`AllowGroups=`; supplementary groups count).
    public var allowGroups: [UInt32] {
        get { settings.allowGroups }
        set { settings.allowGroups = newValue }
    }

    public var policy: RefreshPolicy {
        get { settings.policy }
        set { settings.policy = newValue }
    }

    public init(settings: SessionSettings, origin: String) {
        storage = Storage(settings: settings, fleet: nil, origin: origin, parentOAuth: nil)
    }

    public init(name: String, upstream: Upstream, allowUsers: [UInt32], allowGroups: [UInt32], policy: RefreshPolicy, origin: String) {
        self.init(settings: SessionSettings(name: name), origin: origin)
        self.upstream = upstream
        self.allowUsers = allowUsers
        self.allowGroups = allowGroups
        self.policy = policy
    }

    /// Equal when every key of `ConfigSchema.session` agrees (every field of the settings, which
    /// the keys set), and the fleet does, and a derived session's parent's settings do.
    public static func == (lhs: SessionConfiguration, rhs: SessionConfiguration) -> Bool {
        lhs.storage === rhs.storage
            || lhs.storage.settings == rhs.storage.settings && same(lhs.storage.fleet, rhs.storage.fleet)
            && same(lhs.storage.parentOAuth, rhs.storage.parentOAuth)
    }

    /// Whether the two are one value, not two equal ones (a configuration load took `other` as
    /// it was: `SessionMemo`).
    func isSame(as other: SessionConfiguration) -> Bool { storage === other.storage }

    /// Optional's `==`, without its copies of two large values into a tuple when both are nil
    /// (a reload compares every session: most have no fleet and no parent).
    private static func same<Value: Equatable>(_ lhs: Value?, _ rhs: Value?) -> Bool {
        switch lhs {
        case .none:
            if case .none = rhs { return true }
            return false
        case .some(let left):
            guard case .some(let right) = rhs else { return false }
            return left == right
        }
    }

    /// Whether a key that shapes the coordinator differs (`ConfigChange.rebuildsSession`: a
    /// reload then rebuilds it), or the fleet does; access lists can change without touching
    /// tokens. (A session none of whose settings changed is told at once: a reload of
    /// thousands of sessions compares each key only for the few that changed.)
    public func needsNewCoordinator(comparedTo other: SessionConfiguration) -> Bool {
        // A derived session asks its parent's server as its parent's settings say.
        if fleet != other.fleet || parentOAuth != other.parentOAuth { return true }
        if settings == other.settings { return false }
        return ConfigSchema.session.contains { $0.change == .rebuildsSession && !$0.same(settings, other.settings) }
    }
}
