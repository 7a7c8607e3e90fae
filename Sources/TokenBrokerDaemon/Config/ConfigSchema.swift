#if canImport(Glibc)
import Glibc
#endif
import Basics
import BrokerContract
import DPoP
import Fleet
import TokenBrokerCore
import Upstream
import HTTPTransport

/// Every configuration key, section by section: the one list that parsing (`ConfigLoader`),
/// reload equality (`SessionConfiguration.needsNewCoordinator`, `==`), `check-config --keys`
/// and the documentation test (`config/*.conf`, the man page, doc/configuration.md) follow.
public enum ConfigSchema {
    public static let broker: [ConfigKey<BrokerConfiguration>] = [
        ConfigKey("Socket", takes: "an absolute path", default: BrokerConfiguration.defaultSocket, change: .atStart,
                  "where the varlink socket is bound (serve --socket overrides it)",
                  same: { $0.socketPath == $1.socketPath }) { settings, entry, _ throws(ConfigError) in
            guard entry.value.hasPrefix("/") else { throw fail(entry, "Socket= needs an absolute path") }
            settings.socketPath = entry.value
        },
        ConfigKey("SocketMode", takes: "an octal mode", default: "0660", change: .atStart, "mode of the socket file",
                  same: { $0.socketMode == $1.socketMode }) { settings, entry, _ throws(ConfigError) in
            guard let mode = ConfigValue.mode(entry.value) else { throw fail(entry, "SocketMode= needs an octal mode such as 0660") }
            settings.socketMode = mode
        },
        ConfigKey("SocketGroup", \.socketGroup, .group, change: .atStart, "group owning the socket file (the daemon's when empty)"),
        ConfigKey("AdminGroup", \.adminGroup, .group, change: .atReload,
                  "members may log sessions in and out, reload, and see every session"),
        ConfigKey("MaxConnections", \.maxConnections, .count(1...1_000_000), default: "4096", change: .atStart,
                  "connections served at once (the last 1/32, at most 128, kept for admins)"),
        ConfigKey("MaxConnectionsPerUser", \.maxConnectionsPerUser, .count(1...1_000_000), default: "256", change: .atStart,
                  "connections one user that is not an admin may hold"),
        // At most 1M: parsing is linear, but one message is parsed in one go on the I/O thread
        // (the worst 1M message costs other clients ~45 ms; the default 64K, ~3 ms).
        ConfigKey("MaxMessageSize", \.maxMessageSize, .size(1024...(1 << 20), "1K to 1M"), default: "64K", change: .atStart,
                  "largest varlink message accepted"),
        ConfigKey("MaxObjectMembers", \.maxObjectMembers, .count(16...1_000_000), default: "1024", change: .atStart,
                  "most members in one JSON object of a message"),
        ConfigKey("MessageTimeout", \.messageTimeout,
                  .duration(.milliseconds(100)...Duration.seconds(3600), message: "MessageTimeout= needs a time span between 0.1s and 3600s, e.g. 10s"),
                  default: "10s", change: .atStart, "a message must be complete this long after its first byte"),
        ConfigKey("AuditBurst", \.auditBurst, .count(0...100_000), default: "10", change: .atStart,
                  "audit records one peer writes to the journal per AuditInterval= (0: none)"),
        ConfigKey("AuditInterval", \.auditInterval, .duration(.seconds(1)...Duration.seconds(86400)), default: "60s", change: .atStart,
                  "the interval of AuditBurst=, after which one line says how many were left out"),
        ConfigKey("MaxQueuedOutput", \.maxQueuedOutput, .size(64 << 10...(4 << 30), "64K to 4G"), default: "32M", change: .atStart,
                  "replies queued for all clients together"),
        ConfigKey("MetricsListen", takes: "a loopback host:port or an absolute socket path", change: .atStart,
                  "serve Prometheus metrics (GET /metrics) there; off when empty",
                  same: { $0.metricsListen == $1.metricsListen }) { settings, entry, _ throws(ConfigError) in
            guard !entry.value.isEmpty else {
                settings.metricsListen = nil
                return
            }
            guard let address = ListenAddress(entry.value) else {
                throw fail(entry, "MetricsListen= needs a loopback address and port (127.0.0.1:9464, [::1]:9464) or an absolute socket path")
            }
            settings.metricsListen = address
        },
        ConfigKey("MetricsGroup", \.metricsGroup, .group, change: .atStart,
                  "members may read the per-session series on a Unix MetricsListen="),
        metricsBearerToken("MetricsBearerTokenFile"),
        metricsBearerToken("MetricsBearerTokenCredential"),
        ConfigKey("StateKeyCredential", \.stateKey, .key, change: .atStart,
                  "seal the tokens in the state database with this key, not the package's or state.key"),
        ConfigKey("StateKeyFile", \.stateKey, .key, change: .atStart, "the state key from a file instead of a credential"),
    ]

    private static func metricsBearerToken(_ name: String) -> ConfigKey<BrokerConfiguration> {
        ConfigKey(name, takes: "16 to 4096 visible ASCII characters, from a file or credential", change: .atStart,
                  "the bearer token a scraper sends for the per-session series",
                  same: { $0.metricsBearerToken == $1.metricsBearerToken }) { settings, entry, context throws(ConfigError) in
            guard !entry.value.isEmpty else {
                settings.metricsBearerToken = nil
                return
            }
            let token = try ConfigParsing.readSecret(entry, &context)
            // What Prometheus sends as `credentials`: one line of visible ASCII, long enough.
            guard token.reveal.utf8.count >= 16, token.reveal.utf8.count <= 4096,
                  token.reveal.utf8.allSatisfy({ $0 > 0x20 && $0 < 0x7F }) else {
                throw fail(entry, "\(entry.key)=: the token must be 16 to 4096 visible ASCII characters (e.g. openssl rand -hex 32)")
            }
            settings.metricsBearerToken = token
        }
    }

    public static let session: [ConfigKey<SessionSettings>] = [
        ConfigKey("Name", takes: "1-64 of A-Z a-z 0-9 - _ .", change: .keepsSession, "the session's name, as workers ask for it (required)",
                  same: { $0.name == $1.name }) { _, _, _ throws(ConfigError) in },
        ConfigKey("Fleet", \.fleet, .bool, default: "no", change: .rebuildsSession, "share the session with the brokers of a fleet"),
        ConfigKey("Upstream", \.kind, .oneOf(SessionSettings.Kind.self, [.oauth, .test], message: "Upstream= must be 'oauth' or 'test'"),
                  default: "oauth", change: .rebuildsSession, "where tokens come from: an OAuth server, or minted here for tests"),
        ConfigKey("TestTokenLifetime", \.testTokenLifetime, .duration(.seconds(1)...Duration.seconds(86400 * 30)), default: "1h",
                  change: .rebuildsSession, "lifetime of the tokens the test upstream mints"),
        ConfigKey("Grant", \.oauth.grant,
                  .oneOf(SessionConfiguration.OAuthGrant.self, [.refreshToken, .clientCredentials, .jwtBearer],
                         message: "Grant= must be refresh_token, client_credentials or jwt-bearer"),
                  default: "refresh_token", change: .rebuildsSession, "the OAuth grant"),
        assertionFile("AssertionFile", takes: "an absolute path", "Grant=jwt-bearer: the JWT presented as the grant (RFC 7523 §2.1), read again when it changes",
                      \.oauth.grantAssertionFile),
        assertionFile("AssertionCredential", takes: "a credential name", "Grant=jwt-bearer: the JWT, from a systemd credential",
                      \.oauth.grantAssertionFile),
        ConfigKey("Issuer", \.oauth.issuer, .url, change: .rebuildsSession, "the issuer, for RFC 8414 discovery of the endpoints"),
        ConfigKey("TokenEndpoint", \.oauth.tokenEndpoint, .url, change: .rebuildsSession, "the token endpoint (wins over discovery)"),
        ConfigKey("RevocationEndpoint", \.oauth.revocationEndpoint, .url, change: .rebuildsSession, "the RFC 7009 revocation endpoint"),
        ConfigKey("DeviceAuthorizationEndpoint", \.oauth.deviceAuthorizationEndpoint, .url, change: .rebuildsSession,
                  "the RFC 8628 device authorization endpoint"),
        ConfigKey("AuthorizationEndpoint", \.oauth.authorizationEndpoint, .url, change: .rebuildsSession,
                  "where a code login sends the browser (RFC 6749 §3.1)"),
        ConfigKey("LoginFlow", \.oauth.login.flow,
                  .oneOf(SessionConfiguration.InteractiveLoginSettings.Flow.self, [.auto, .device, .code],
                         message: "LoginFlow= must be auto, device or code"),
                  default: "auto", change: .keepsSession, "how ctl login logs in: auto is device where the server offers it, else code"),
        ConfigKey("LoginRedirectPorts", takes: "ports or ranges such as 8400-8409, space-separated (empty: any free port)",
                  change: .keepsSession, "the loopback ports a code login listens on for the browser's redirect, the first free one",
                  same: { $0.oauth.login.redirectPorts == $1.oauth.login.redirectPorts }) { settings, entry, _ throws(ConfigError) in
            settings.oauth.login.redirectPorts = try ConfigParsing.ports(entry)
        },
        ConfigKey("LoginTimeout", \.oauth.login.timeout, .duration(.seconds(1)...Duration.seconds(3600)), default: "5min",
                  change: .keepsSession, "how long a code login waits for the browser's redirect"),
        ConfigKey("ClientID", takes: "text", change: .rebuildsSession, "the client registration's id",
                  same: { $0.oauth.client.clientID == $1.oauth.client.clientID }) { settings, entry, _ throws(ConfigError) in
            settings.oauth.client.clientID = entry.value
        },
        clientSecret("ClientSecretFile", takes: "an absolute path", "the client secret, from a file"),
        clientSecret("ClientSecretCredential", takes: "a credential name", "the client secret, from a systemd credential"),
        clientSecret("ClientSecret", takes: "text (warns: prefer a file or credential)", "the client secret itself"),
        ConfigKey("ClientAuthentication", \.oauth.client.authentication,
                  .oneOf(ClientAuthentication.self, [.basic, .post, .none, .privateKeyJWT],
                         message: "ClientAuthentication= must be client_secret_basic, client_secret_post, private_key_jwt or none"),
                  default: "client_secret_basic", change: .rebuildsSession,
                  "how the client authenticates (private_key_jwt: a JWT signed by a key the daemon holds, ClientKeyFile='s, or ClientAssertionFile=)"),
        clientKey("ClientKeyFile", takes: "an absolute path to a PEM private key (P-256 or RSA)",
                  "private_key_jwt: sign with this key instead of one the daemon makes and holds"),
        clientKey("ClientKeyCredential", takes: "a credential name", "private_key_jwt: the signing key, from a systemd credential"),
        assertionFile("ClientAssertionFile", takes: "an absolute path",
                      "private_key_jwt: send the JWT a platform keeps in this file (read again when it changes) instead of signing one",
                      \.oauth.client.assertionFile),
        assertionFile("ClientAssertionCredential", takes: "a credential name", "private_key_jwt: the client assertion, from a systemd credential",
                      \.oauth.client.assertionFile),
        ConfigKey("ClientAssertionAudience", takes: "issuer, token-endpoint, endpoint, or a value", change: .rebuildsSession,
                  "the aud of signed assertions: the issuer (the default with Issuer=), the token endpoint (the default without), the URL "
                  + "each request goes to, or a value the server names",
                  same: { $0.oauth.client.assertionAudience == $1.oauth.client.assertionAudience }) { settings, entry, _ throws(ConfigError) in
            guard entry.value.utf8.count <= 512, entry.value.utf8.allSatisfy({ $0 > 0x20 && $0 < 0x7F }) else {
                throw fail(entry, "ClientAssertionAudience= must be issuer, token-endpoint, endpoint, or a value of visible ASCII characters")
            }
            settings.oauth.client.assertionAudience = entry.value.isEmpty ? nil : entry.value
        },
        ConfigKey("ClientAssertionAlgorithm", takes: "auto, ES256, RS256 or PS256", default: "auto", change: .rebuildsSession,
                  "what signed assertions are signed with; auto: ES256 unless the server's metadata lists only RSA ones",
                  same: { $0.oauth.client.assertionAlgorithm == $1.oauth.client.assertionAlgorithm }) { settings, entry, _ throws(ConfigError) in
            guard entry.value == "auto" || entry.value.isEmpty else {
                guard let algorithm = SigningKey.Algorithm(rawValue: entry.value) else {
                    throw fail(entry, "ClientAssertionAlgorithm= must be auto, ES256, RS256 or PS256")
                }
                settings.oauth.client.assertionAlgorithm = algorithm
                return
            }
            settings.oauth.client.assertionAlgorithm = nil
        },
        ConfigKey("Scope", \.oauth.client.scope, .text, change: .rebuildsSession, "scope for client_credentials, device and code logins"),
        ConfigKey("CAFile", \.oauth.client.tls.caFile, .file, change: .rebuildsSession, "trust only this CA (PEM) for the authorization server"),
        ConfigKey("ClientCertificate", \.oauth.client.tls.clientCertificate, .file, change: .rebuildsSession,
                  "a client certificate (PEM) for mutual TLS"),
        ConfigKey("ClientKey", \.oauth.client.tls.clientKey, .secretFile, change: .rebuildsSession, "its key (PEM)"),
        ConfigKey("ConnectTimeout", \.oauth.client.connectTimeout, .duration(.milliseconds(100)...Duration.seconds(300)), default: "5s",
                  change: .rebuildsSession, "connect timeout of each request"),
        ConfigKey("RequestTimeout", \.oauth.client.timeout, .duration(.milliseconds(100)...Duration.seconds(600)), default: "30s",
                  change: .rebuildsSession, "total deadline of each request"),
        ConfigKey("RevokeOnLogout", \.oauth.revokeOnLogout, .bool, default: "yes", change: .rebuildsSession,
                  "revoke the refresh token upstream at logout"),
        ConfigKey("DPoP", \.oauth.dpop, .oneOf(DPoPMode.self, [.off, .on, .auto], message: "DPoP= must be yes, no or auto"),
                  default: "no", change: .rebuildsSession,
                  "bind the tokens to a key the daemon holds (RFC 9449): workers get proofs, never the key; auto: as Issuer='s metadata says"),
        allowList("AllowUsers", \.allowUsers, "users (names or uids) who may use the session",
                  lookup: { context, name in context.userID(name) }, overflow: ProcessDefences.overflowUID),
        allowList("AllowGroups", \.allowGroups, "groups whose members may use the session",
                  lookup: { context, name in context.groupID(name) }, overflow: ProcessDefences.overflowGID),
        ConfigKey("Serves", takes: "URLs or hosts, space-separated (empty clears)", change: .keepsSession,
                  "the URLs credential helpers (git, kubectl, registries) get this session's token for",
                  same: { $0.serves == $1.serves }) { settings, entry, _ throws(ConfigError) in
            if entry.value.isEmpty { settings.serves = [] }
            for word in ConfigValue.list(entry.value) {
                guard let served = ServedURL(word) else {
                    throw fail(entry, "Serves=: '\(word)' is not a URL or host (e.g. https://git.example.com/org or registry.example.com:5000)")
                }
                settings.serves.append(served)
            }
            guard settings.serves.count <= 64 else { throw fail(entry, "Serves= lists more than 64 URLs") }
        },
        ConfigKey("DerivedFrom", takes: "a session's name", change: .rebuildsSession,
                  "derive this session's tokens from another session's (its parent), narrowed by Audience=, Resource= and Scope=",
                  same: { $0.derivedFrom == $1.derivedFrom }) { settings, entry, _ throws(ConfigError) in
            guard ConfigValue.isSessionName(entry.value) else { throw fail(entry, "DerivedFrom=: '\(entry.value)' is not a session name") }
            settings.derivedFrom = entry.value
        },
        ConfigKey("Derivation", \.derivation,
                  .oneOf(SessionConfiguration.DerivationMethod.self, [.exchange, .refresh], message: "Derivation= must be exchange or refresh"),
                  default: "exchange", change: .rebuildsSession,
                  "how a derived session gets its tokens: RFC 8693 token exchange of the parent's access token"),
        ConfigKey("Audience", takes: "audiences, space-separated (empty clears)", change: .rebuildsSession,
                  "the audiences a derived session's tokens are for (RFC 8693 audience)",
                  same: { $0.audiences == $1.audiences }) { settings, entry, _ throws(ConfigError) in
            settings.audiences = try targets(entry, settings.audiences, what: "audience") { _ in true }
        },
        ConfigKey("Resource", takes: "absolute URLs, space-separated (empty clears)", change: .rebuildsSession,
                  "the resources a derived session's tokens are for (RFC 8707 resource indicators)",
                  same: { $0.resources == $1.resources }) { settings, entry, _ throws(ConfigError) in
            // RFC 8707 §2: an absolute URI without a fragment.
            settings.resources = try targets(entry, settings.resources, what: "resource") { word in
                guard let url = StrictURL(word), url.scheme != nil, !word.contains("#") else { return false }
                return true
            }
        },
        ConfigKey("AllowResources", takes: "absolute URLs, space-separated (empty clears)", change: .rebuildsSession,
                  "the resources callers may ask this session's token narrowed to (resource= on GetToken and Recover)",
                  same: { $0.allowResources == $1.allowResources }) { settings, entry, _ throws(ConfigError) in
            settings.allowResources = try targets(entry, settings.allowResources, what: "resource", limit: 64) { word in
                TokenKey.isResource(word) && StrictURL(word)?.scheme != nil
            }
        },
        ConfigKey("AllowScopes", takes: "scope words, space-separated (empty clears)", change: .rebuildsSession,
                  "the scope words callers may ask this session's token narrowed to (scope= on GetToken and Recover)",
                  same: { $0.allowScopes == $1.allowScopes }) { settings, entry, _ throws(ConfigError) in
            settings.allowScopes = try targets(entry, settings.allowScopes, what: "scope word", limit: 64) { word in
                !word.contains("\"") && !word.contains("\\")
            }
        },
        ConfigKey("KeyDerivation", \.keyDerivation,
                  .oneOf(SessionConfiguration.DerivationMethod.self, [.exchange, .refresh], message: "KeyDerivation= must be exchange or refresh"),
                  default: "exchange", change: .rebuildsSession,
                  "how keys asked for per call get their tokens: RFC 8693 token exchange of the session's access token, or its refresh "
                  + "token redeemed with the resource and scope (refresh, RFC 8707 §2.2) in the session's one lineage"),
        ConfigKey("MaxKeys", \.maxKeys, .count(1...1024), default: "32", change: .rebuildsSession,
                  "how many narrowed tokens (keys) the session keeps at most; the least recently used goes first"),
        ConfigKey("RefreshAhead", \.policy.refreshAhead, .duration(.zero...Duration.seconds(86400)), default: "60s", change: .rebuildsSession,
                  "refresh in the background this long before expiry (0: off)"),
        ConfigKey("RefreshLimitBurst", \.policy.guardLimit, .count(1...10_000), default: "10", change: .rebuildsSession,
                  "upstream requests the refresh guard allows on top of what the lifetime needs"),
        ConfigKey("RefreshLimitInterval", \.policy.guardWindow, .duration(.seconds(1)...Duration.seconds(86400)), default: "60s",
                  change: .rebuildsSession, "the refresh guard's sliding window"),
        ConfigKey("BackoffInitial", \.policy.backoff.initial, .duration(.milliseconds(10)...Duration.seconds(3600)), default: "1s",
                  change: .rebuildsSession, "first backoff after a transient failure"),
        ConfigKey("BackoffMax", \.policy.backoff.maximum, .duration(.milliseconds(10)...Duration.seconds(86400)), default: "5min",
                  change: .rebuildsSession, "longest backoff"),
    ]

    /// The three ways to give the client secret: the last one written wins, and it is read when
    /// the session is complete (a drop-in may replace a file the main configuration names).
    private static func clientSecret(_ name: String, takes: String, _ summary: String) -> ConfigKey<SessionSettings> {
        ConfigKey(name, takes: takes, change: .rebuildsSession, summary,
                  same: { $0.oauth.client.clientSecret == $1.oauth.client.clientSecret }) { settings, entry, _ throws(ConfigError) in
            settings.secretSource = entry
        }
    }

    /// The two ways to give an operator's signing key: the last one written wins, read when the
    /// session is complete.
    private static func clientKey(_ name: String, takes: String, _ summary: String) -> ConfigKey<SessionSettings> {
        ConfigKey(name, takes: takes, change: .rebuildsSession, summary,
                  same: { $0.oauth.client.clientKey == $1.oauth.client.clientKey }) { settings, entry, _ throws(ConfigError) in
            settings.clientKeySource = entry.value.isEmpty ? nil : entry
        }
    }

    /// A JWT's file (a path, or a credential's name: its file in `$CREDENTIALS_DIRECTORY`), read
    /// at each request, not at load: the platform may write it later.
    private static func assertionFile(_ name: String, takes: String, _ summary: String,
                                      _ path: @autoclosure @escaping @Sendable () -> WritableKeyPath<SessionSettings, String?>) -> ConfigKey<SessionSettings> {
        // (The key path made at its first use: see ConfigKey.)
        ConfigKey(name, takes: takes, change: .rebuildsSession, summary,
                  same: { let path = path(); return $0[keyPath: path] == $1[keyPath: path] }) { settings, entry, _ throws(ConfigError) in
            let path = path()
            guard !entry.value.isEmpty else {
                settings[keyPath: path] = nil
                return
            }
            if entry.key.hasSuffix("Credential") {
                guard let directory = getenv("CREDENTIALS_DIRECTORY").map({ String(cString: $0) }) else {
                    throw fail(entry, "\(entry.key)=: $CREDENTIALS_DIRECTORY is not set (use LoadCredential= in the unit)")
                }
                guard !entry.value.contains("/") else { throw fail(entry, "\(entry.key)= needs a credential name") }
                settings[keyPath: path] = directory + "/" + entry.value
            } else {
                guard entry.value.hasPrefix("/") else { throw fail(entry, "\(entry.key)= needs an absolute path") }
                settings[keyPath: path] = entry.value
            }
        }
    }

    /// A derived session's audiences or resources: an empty value clears them, each word adds
    /// one (at most 16, each 1 to 512 visible ASCII characters that `valid` takes).
    private static func targets(_ entry: INIEntry, _ current: [String], what: String, limit: Int = 16,
                                valid: (String) -> Bool) throws(ConfigError) -> [String] {
        guard !entry.value.isEmpty else { return [] }
        var targets = current
        for word in ConfigValue.list(entry.value) {
            guard word.utf8.count <= 512, word.utf8.allSatisfy({ $0 > 0x20 && $0 < 0x7F }), valid(word) else {
                throw fail(entry, "\(entry.key)=: '\(word.prefix(64))' is not a valid \(what)"
                           + (what == "resource" ? " (an absolute URL without a fragment, RFC 8707)" : ""))
            }
            if !targets.contains(word) { targets.append(word) }
        }
        guard targets.count <= limit else { throw fail(entry, "\(entry.key)= lists more than \(limit) \(what)s") }
        return targets
    }

    /// An allow list: an empty value clears it, each word adds a name or a number.
    private static func allowList<Settings>(_ name: String, _ path: @autoclosure @escaping @Sendable () -> WritableKeyPath<Settings, [UInt32]>,
                                            _ summary: String, lookup: @escaping @Sendable (inout ConfigContext, String) -> UInt32?, overflow: UInt32,
                                            change: ConfigChange = .keepsSession) -> ConfigKey<Settings> {
        ConfigKey(name, takes: "names or numbers, space-separated (empty clears)", change: change, summary,
                  same: { let path = path(); return $0[keyPath: path] == $1[keyPath: path] }) { settings, entry, context throws(ConfigError) in
            let path = path()
            if entry.value.isEmpty { settings[keyPath: path] = [] }
            for word in ConfigValue.list(entry.value) {
                let id = try resolve(word, entry) { lookup(&context, $0) }
                if id == overflow { context.warn(entry, overflowWarning(entry.key, word)) }
                settings[keyPath: path].append(id)
            }
        }
    }

    public static let fleet: [ConfigKey<FleetDraft>] = [
        ConfigKey("Endpoints", takes: "etcd client URLs, space-separated (empty clears)", change: .rebuildsSession,
                  "the etcd members, tried in order (required)", same: { $0.endpoints == $1.endpoints }) { settings, entry, _ throws(ConfigError) in
            if entry.value.isEmpty { settings.endpoints = [] }
            for word in ConfigValue.list(entry.value) {
                var url = word
                while url.hasSuffix("/") { url.removeLast() }
                if let problem = EndpointPolicy.problemBeforeLibcurl(with: url) { throw fail(entry, "Endpoints=: \(problem)") }
                settings.endpoints.append(url)
            }
        },
        ConfigKey("Prefix", takes: "a key prefix such as /tokenbroker", default: "/tokenbroker", change: .rebuildsSession,
                  "where the fleet's keys live in etcd", same: { $0.prefix == $1.prefix }) { settings, entry, _ throws(ConfigError) in
            let bytes = Array(entry.value.utf8)
            guard entry.value.hasPrefix("/"), !entry.value.hasSuffix("/"), (2...128).contains(bytes.count),
                  bytes.allSatisfy({ $0 > 0x20 && $0 < 0x7F }) else {
                throw fail(entry, "Prefix= needs a key prefix such as /tokenbroker (2-128 printable characters, starting with / and not ending with one)")
            }
            settings.prefix = entry.value
        },
        ConfigKey("CAFile", \.tls.caFile, .file, change: .rebuildsSession, "trust only this CA (PEM) for etcd"),
        ConfigKey("ClientCertificate", \.tls.clientCertificate, .file, change: .rebuildsSession, "a client certificate (PEM) for etcd"),
        ConfigKey("ClientKey", \.tls.clientKey, .secretFile, change: .rebuildsSession, "its key (PEM)"),
        ConfigKey("KeyCredential", \.key, .key, change: .rebuildsSession, "the fleet key, sealing every value in etcd (required)"),
        ConfigKey("KeyFile", \.key, .key, change: .rebuildsSession, "the fleet key from a file instead of a credential"),
        ConfigKey("FlightLease", \.flightLease, .duration(.seconds(5)...Duration.seconds(3600)), default: "60s", change: .rebuildsSession,
                  "how long a vanished flight holder keeps the others from refreshing"),
        ConfigKey("RequestTimeout", \.requestTimeout, .duration(.milliseconds(100)...Duration.seconds(60)), default: "2s",
                  change: .rebuildsSession, "the deadline of one request to one etcd member"),
        ConfigKey("Name", takes: "1-64 printable characters without spaces", default: "the host name", change: .rebuildsSession,
                  "this broker's name in flight records and status", same: { $0.member == $1.member }) { settings, entry, _ throws(ConfigError) in
            guard !entry.value.isEmpty, entry.value.utf8.count <= 64, entry.value.utf8.allSatisfy({ $0 > 0x20 && $0 < 0x7F }) else {
                throw fail(entry, "Name= needs 1-64 printable characters without spaces")
            }
            settings.member = entry.value
        },
    ]

    public static let delegation: [ConfigKey<DelegationConfiguration>] = [
        ConfigKey("Name", takes: "1-64 of A-Z a-z 0-9 - _ .", change: .atReload, "the delegation's name (required)",
                  same: { $0.name == $1.name }) { settings, entry, _ throws(ConfigError) in
            guard DelegationConfiguration.isName(entry.value) else { throw fail(entry, "Name=: '\(entry.value)' is not a delegation name (1-64 of A-Z a-z 0-9 - _ .)") }
            settings.name = entry.value
        },
        ConfigKey("Sessions", takes: "session names, space-separated (empty clears)", change: .atReload,
                  "the sessions its socket serves (required)", same: { $0.sessions == $1.sessions }) { settings, entry, _ throws(ConfigError) in
            if entry.value.isEmpty { settings.sessions = [] }
            for word in ConfigValue.list(entry.value) {
                guard ConfigValue.isSessionName(word) else { throw fail(entry, "Sessions=: '\(word)' is not a session name") }
                if !settings.sessions.contains(word) { settings.sessions.append(word) }
            }
            if settings.sessions.count > DelegationConfiguration.mostSessions {
                throw fail(entry, "Sessions= names more than \(DelegationConfiguration.mostSessions) sessions")
            }
        },
        ConfigKey("Socket", takes: "an absolute path", change: .atReload, "where its socket is bound (required)",
                  same: { $0.socket == $1.socket }) { settings, entry, _ throws(ConfigError) in
            guard let problem = DelegationConfiguration.socketProblem(entry.value) else {
                settings.socket = entry.value
                return
            }
            throw fail(entry, "Socket=: \(problem)")
        },
        ConfigKey("SocketUser", \.socketUser, .user, change: .atReload, "user owning the socket file (the daemon's when empty)"),
        ConfigKey("SocketGroup", \.socketGroup, .group, change: .atReload, "group owning the socket file (the daemon's when empty)"),
        ConfigKey("SocketMode", takes: "an octal mode", default: "0660", change: .atReload, "mode of the socket file",
                  same: { $0.socketMode == $1.socketMode }) { settings, entry, _ throws(ConfigError) in
            guard let mode = ConfigValue.mode(entry.value) else { throw fail(entry, "SocketMode= needs an octal mode such as 0660") }
            settings.socketMode = mode
        },
        allowList("AllowUsers", \DelegationConfiguration.allowUsers, "only these users (names or uids) may use the socket",
                  lookup: { context, name in context.userID(name) }, overflow: ProcessDefences.overflowUID, change: .atReload),
        allowList("AllowGroups", \DelegationConfiguration.allowGroups, "only members of these groups may use the socket",
                  lookup: { context, name in context.groupID(name) }, overflow: ProcessDefences.overflowGID, change: .atReload),
        ConfigKey("MaxConnections", \.maxConnections, .count(1...65_536), default: "64", change: .atReload,
                  "connections open on its socket at once"),
    ]

    public static let output: [ConfigKey<TokenFileConfiguration>] = [
        ConfigKey("Name", takes: "1-64 of A-Z a-z 0-9 - _ .", change: .atReload, "the output's name (required; not a delegation's)",
                  same: { $0.name == $1.name }) { settings, entry, _ throws(ConfigError) in
            guard DelegationConfiguration.isName(entry.value) else { throw fail(entry, "Name=: '\(entry.value)' is not an output name (1-64 of A-Z a-z 0-9 - _ .)") }
            settings.name = entry.value
        },
        ConfigKey("Session", takes: "a session name", change: .atReload, "the session whose token the file holds (required)",
                  same: { $0.session == $1.session }) { settings, entry, _ throws(ConfigError) in
            guard ConfigValue.isSessionName(entry.value) else { throw fail(entry, "Session=: '\(entry.value)' is not a session name") }
            settings.session = entry.value
        },
        ConfigKey("Path", takes: "an absolute path", change: .atReload, "where the file is kept (required)",
                  same: { $0.path == $1.path }) { settings, entry, _ throws(ConfigError) in
            if let problem = TokenFileConfiguration.pathProblem(entry.value) { throw fail(entry, "Path=: \(problem)") }
            settings.path = entry.value
        },
        ConfigKey("Format", takes: "token, header or json", default: "token", change: .atReload,
                  "the bare token, an Authorization: header line, or JSON with its type, expiry and serial",
                  same: { $0.format == $1.format }) { settings, entry, _ throws(ConfigError) in
            guard let format = TokenFileFormat(rawValue: entry.value) else { throw fail(entry, "Format= needs token, header or json") }
            settings.format = format
        },
        ConfigKey("User", \.user, .user, change: .atReload, "user owning the file (the daemon's when empty; another needs a daemon run as root)"),
        ConfigKey("Group", \.group, .group, change: .atReload, "group owning the file (the daemon's when empty)"),
        ConfigKey("Mode", takes: "an octal mode", default: "0600", change: .atReload, "mode of the file (read and its owner's write bits only)",
                  same: { $0.mode == $1.mode }) { settings, entry, _ throws(ConfigError) in
            guard let mode = ConfigValue.mode(entry.value), mode & ~TokenFileConfiguration.modeBits == 0 else {
                throw fail(entry, "Mode= needs an octal mode with read bits and its owner's write bit only, such as 0640")
            }
            settings.mode = mode
        },
        allowList("Readers", \TokenFileConfiguration.readers, "users (names or uids) who may read the file too (a POSIX ACL entry each)",
                  lookup: { context, name in context.userID(name) }, overflow: ProcessDefences.overflowUID, change: .atReload),
    ]

    static let brokerKeys = index(broker)
    static let sessionKeys = index(session)
    static let fleetKeys = index(fleet)
    static let delegationKeys = index(delegation)
    static let outputKeys = index(output)

    private static func index<Settings>(_ keys: [ConfigKey<Settings>]) -> ConfigKeyIndex<Settings> {
        ConfigKeyIndex(keys)
    }

    /// The sections and their keys, for documentation: (section, name, takes, default, summary, change).
    public static var reference: [(section: String, keys: [(name: String, takes: String, defaultValue: String, summary: String, change: ConfigChange)])] {
        func rows<Settings>(_ keys: [ConfigKey<Settings>]) -> [(name: String, takes: String, defaultValue: String, summary: String, change: ConfigChange)] {
            keys.map { ($0.name, $0.takes, $0.defaultValue, $0.summary, $0.change) }
        }
        return [("Broker", rows(broker)), ("Session", rows(session)), ("Fleet", rows(fleet)), ("Delegation", rows(delegation)), ("Output", rows(output))]
    }

    /// A known key of `keys` that `name` is probably a misspelling of.
    static func suggestion<Settings>(for name: String, in keys: [ConfigKey<Settings>]) -> String? {
        Spelling.closest(to: name, in: keys.lazy.map(\.name))
    }
}

/// A `[Session]` as its keys set it, before it is checked as a whole. Equal when every field
/// is (a fast check that nothing differs; what a difference does is the table's to say).
public struct SessionSettings: Sendable, Equatable {
    public enum Kind: String, Sendable, Equatable {
        case oauth
        case test
    }

    public var name: String
    public var fleet = false
    public var kind = Kind.oauth
    public var testTokenLifetime = Duration.seconds(3600)
    public var oauth = SessionConfiguration.OAuthSettings(client: SessionConfiguration.OAuthClientSettings())
    /// The last of ClientSecretFile=, ClientSecretCredential=, ClientSecret= (read when the
    /// session is complete).
    var secretSource: INIEntry?
    /// The last of ClientKeyFile=, ClientKeyCredential= (read when the session is complete).
    var clientKeySource: INIEntry?
    public var allowUsers: [UInt32] = []
    public var allowGroups: [UInt32] = []
    public var policy = RefreshPolicy()
    /// What credential helpers get this session's token for (`Serves=`).
    public var serves: [ServedURL] = []
    /// A derived session's parent (`DerivedFrom=`); nil for a session with an upstream of its own.
    public var derivedFrom: String?
    public var derivation = SessionConfiguration.DerivationMethod.exchange
    /// What a derived session narrows its parent's tokens to (`Audience=`, `Resource=`).
    public var audiences: [String] = []
    public var resources: [String] = []
    /// What callers may narrow this session's token to, call by call (`AllowResources=`,
    /// `AllowScopes=`), and how many such keys it keeps at most (`MaxKeys=`).
    public var allowResources: [String] = []
    public var allowScopes: [String] = []
    public var maxKeys = 32
    /// How keys get their tokens (`KeyDerivation=`).
    public var keyDerivation = SessionConfiguration.DerivationMethod.exchange

    public init(name: String) { self.name = name }
}

/// A `[Fleet]` section as its keys set it, before it is checked as a whole.
public struct FleetDraft: Sendable {
    var endpoints: [String] = []
    var prefix = "/tokenbroker"
    var tls = TLSOptions()
    var key: SecretBytes?
    var flightLease = Duration.seconds(60)
    var requestTimeout = Duration.seconds(2)
    var member = ProcessDefences.hostName()
}

/// A table's keys by name, found without hashing the name: by its length and its first and
/// last bytes, then compared. A reload of thousands of sessions looks up a key per line, and
/// `String`'s hash (SipHash) was most of a lookup. The first key of a name wins, as in the table.
struct ConfigKeyIndex<Settings: Sendable>: Sendable {
    private var slots: [[ConfigKey<Settings>]]

    init(_ keys: [ConfigKey<Settings>]) {
        slots = Array(repeating: [], count: Self.slotCount)
        for key in keys where self[key.name] == nil { slots[Self.slot(key.name)].append(key) }
    }

    subscript(name: String) -> ConfigKey<Settings>? {
        for key in slots[Self.slot(name)] where key.name == name { return key }
        return nil
    }

    private static var slotCount: Int { 256 }

    private static func slot(_ name: String) -> Int {
        let utf8 = name.utf8
        guard let first = utf8.first, let last = utf8.last else { return 0 }
        return (utf8.count &* 31 &+ Int(first) &* 7 &+ Int(last)) & (slotCount - 1)
    }
}
