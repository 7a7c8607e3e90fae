#if canImport(Glibc)
import Glibc
#endif
import Fleet
import Sealing
import SQLiteStore
import TokenBrokerCore
import Upstream

/// Reads `tokenbroker.conf` and the drop-ins in `tokenbroker.conf.d/*.conf` (in name order) into
/// a `BrokerConfiguration`.
///
/// Later assignments override earlier ones. `[Session]` sections with the same `Name=` merge;
/// list keys (`AllowUsers=`, `AllowGroups=`) accumulate, and an empty assignment clears them.
/// Unknown keys are warnings; bad values are errors at `file:line`.
public enum ConfigLoader {
    public static func load(path: String = BrokerConfiguration.defaultPath, requireMainFile: Bool = true) throws(ConfigError) -> BrokerConfiguration {
        var files: [(String, String)] = []
        switch FileSystem.readText(path) {
        case let .success(text): files.append((path, text))
        case let .failure(error):
            if requireMainFile || error.errno != ENOENT { throw ConfigError(file: path, line: 0, "cannot read: \(error)") }
        }
        let dropInDirectory = path + ".d"
        for name in FileSystem.list(dropInDirectory).filter({ $0.hasSuffix(".conf") }).sorted() {
            let file = dropInDirectory + "/" + name
            switch FileSystem.readText(file) {
            case let .success(text): files.append((file, text))
            case let .failure(error): throw ConfigError(file: file, line: 0, "cannot read: \(error)")
            }
        }
        var sections: [INISection] = []
        for (file, text) in files { sections += try INIFile.parse(text, file: file) }
        return try build(sections)
    }

    static func build(_ sections: [INISection]) throws(ConfigError) -> BrokerConfiguration {
        var configuration = BrokerConfiguration()
        var sessionEntries: [(name: String, origin: INISection, entries: [INIEntry])] = []
        var sessionIndex: [String: Int] = [:]
        for section in sections {
            switch section.name {
            case "Broker":
                for entry in section.entries { try apply(entry, to: &configuration) }
            case "Fleet":
                try fleetSection(section, into: &configuration)
            case "Session":
                guard let nameEntry = section.entries.last(where: { $0.key == "Name" }) else {
                    throw ConfigError(file: section.file, line: section.line, "[Session] needs Name=")
                }
                guard ConfigValue.isSessionName(nameEntry.value) else {
                    throw ConfigError(file: nameEntry.file, line: nameEntry.line,
                                      "invalid session name '\(nameEntry.value)' (1-64 of A-Z a-z 0-9 - _ .)")
                }
                if let index = sessionIndex[nameEntry.value] {
                    sessionEntries[index].entries += section.entries
                } else {
                    sessionIndex[nameEntry.value] = sessionEntries.count
                    sessionEntries.append((nameEntry.value, section, section.entries))
                }
            default:
                configuration.warnings.append(ConfigError(file: section.file, line: section.line, "unknown section [\(section.name)], ignored"))
            }
        }
        for (name, origin, entries) in sessionEntries {
            var session = try session(name, origin: origin, entries: entries, warnings: &configuration.warnings)
            if let entry = entries.last(where: { $0.key == "Fleet" }), ConfigValue.bool(entry.value) == true {
                func fail(_ message: String) -> ConfigError { ConfigError(file: entry.file, line: entry.line, message) }
                guard let fleet = configuration.fleet else { throw fail("Fleet=yes needs a [Fleet] section with Endpoints= and KeyFile= or KeyCredential=") }
                guard case let .oauth(settings) = session.upstream, settings.grant == .refreshToken else {
                    throw fail("Fleet=yes needs an OAuth session with Grant=refresh_token (a refresh token family is what the fleet shares)")
                }
                // The flight's holder gives up its upstream request before its lease ends, leaving
                // time for one commit to etcd: a request that may take longer would be cut short
                // every time.
                let upstream = settings.client.timeout + (settings.issuer.map(Discovery.longest(for:)) ?? .zero)
                guard fleet.flightLease >= upstream + .seconds(5) + fleet.commitReserve else {
                    throw fail("[Fleet] FlightLease= (\(fleet.flightLease.seconds)s) must be at least the session's RequestTimeout= "
                               + "(\(settings.client.timeout.seconds)s)\(settings.issuer == nil ? "" : ", plus its discovery deadline,") plus 5s, "
                               + "plus [Fleet] RequestTimeout= for each endpoint (\(fleet.commitReserve.seconds)s)")
                }
                session.fleet = fleet
            }
            configuration.sessions.append(session)
        }
        return configuration
    }

    /// `[Fleet]`: the etcd cluster shared by the brokers of a fleet, and the key that seals what
    /// they put there.
    private static func fleetSection(_ section: INISection, into configuration: inout BrokerConfiguration) throws(ConfigError) {
        var endpoints: [String] = []
        var prefix = "/tokenbroker"
        var tls = TLSOptions()
        var key: Secret?
        var lease = Duration.seconds(60)
        var timeout = Duration.seconds(2)
        var member = ProcessDefences.hostName()
        for entry in section.entries {
            func fail(_ message: String) -> ConfigError { ConfigError(file: entry.file, line: entry.line, message) }
            func duration(_ range: ClosedRange<Duration>) throws(ConfigError) -> Duration { try durationValue(entry, range) }
            func file() throws(ConfigError) -> String? { try readableFile(entry) }
            switch entry.key {
            case "Endpoints":
                if entry.value.isEmpty { endpoints = [] }
                for word in ConfigValue.list(entry.value) {
                    var url = word
                    while url.hasSuffix("/") { url.removeLast() }
                    if let problem = EndpointPolicy.problemBeforeLibcurl(with: url) { throw fail("Endpoints=: \(problem)") }
                    endpoints.append(url)
                }
            case "Prefix":
                let bytes = Array(entry.value.utf8)
                guard entry.value.hasPrefix("/"), !entry.value.hasSuffix("/"), (2...128).contains(bytes.count),
                      bytes.allSatisfy({ $0 > 0x20 && $0 < 0x7F }) else {
                    throw fail("Prefix= needs a key prefix such as /tokenbroker (2-128 printable characters, starting with / and not ending with one)")
                }
                prefix = entry.value
            case "CAFile":
                tls.caFile = try file()
            case "ClientCertificate":
                tls.clientCertificate = try file()
            case "ClientKey":
                tls.clientKey = try file()
            case "KeyFile", "KeyCredential":
                guard !entry.value.isEmpty else {
                    key = nil
                    continue
                }
                key = try readKey(entry)
            case "FlightLease":
                lease = try duration(.seconds(5)...Duration.seconds(3600))
            case "RequestTimeout":
                timeout = try duration(.milliseconds(100)...Duration.seconds(60))
            case "Name":
                guard !entry.value.isEmpty, entry.value.utf8.count <= 64, entry.value.utf8.allSatisfy({ $0 > 0x20 && $0 < 0x7F }) else {
                    throw fail("Name= needs 1-64 printable characters without spaces")
                }
                member = entry.value
            default:
                configuration.warnings.append(fail("unknown key \(entry.key)= in [Fleet], ignored"))
            }
        }
        func fail(_ message: String) -> ConfigError { ConfigError(file: section.file, line: section.line, message) }
        guard !endpoints.isEmpty else { throw fail("[Fleet] needs Endpoints= (etcd client URLs)") }
        guard let key else { throw fail("[Fleet] needs KeyFile= or KeyCredential= (the fleet key, 32 bytes or 64 hex digits)") }
        if (tls.clientCertificate == nil) != (tls.clientKey == nil) { throw fail("[Fleet] ClientCertificate= and ClientKey= go together") }
        configuration.fleet = FleetSettings(endpoints: endpoints, prefix: prefix, tls: tls, key: key, flightLease: lease,
                                            requestTimeout: timeout, member: member)
    }

    /// A time span within `range`.
    private static func durationValue(_ entry: INIEntry, _ range: ClosedRange<Duration>) throws(ConfigError) -> Duration {
        guard let value = ConfigValue.duration(entry.value), range.contains(value) else {
            throw ConfigError(file: entry.file, line: entry.line,
                              "\(entry.key)= needs a time span between \(range.lowerBound.seconds)s and \(range.upperBound.seconds)s, e.g. 60s or 5min")
        }
        return value
    }

    /// A readable file by absolute path (`nil`: an empty value clears the setting).
    private static func readableFile(_ entry: INIEntry) throws(ConfigError) -> String? {
        guard !entry.value.isEmpty else { return nil }
        guard entry.value.hasPrefix("/") else { throw ConfigError(file: entry.file, line: entry.line, "\(entry.key)= needs an absolute path") }
        guard access(entry.value, R_OK) == 0 else { throw ConfigError(file: entry.file, line: entry.line, "\(entry.key)=: cannot read \(entry.value)") }
        return entry.value
    }

    /// A 32-byte key (`StateKey…=`, `[Fleet] Key…=`) from a file or a systemd credential,
    /// checked, kept as Latin-1 text so that any 32 raw bytes round-trip.
    private static func readKey(_ entry: INIEntry) throws(ConfigError) -> Secret {
        func fail(_ message: String) -> ConfigError { ConfigError(file: entry.file, line: entry.line, message) }
        let path: String
        if entry.key.hasSuffix("Credential") {
            guard let directory = getenv("CREDENTIALS_DIRECTORY").map({ String(cString: $0) }) else {
                throw fail("\(entry.key)=: $CREDENTIALS_DIRECTORY is not set (use LoadCredential= in the unit)")
            }
            guard !entry.value.contains("/") else { throw fail("\(entry.key)= needs a credential name") }
            path = directory + "/" + entry.value
        } else {
            guard entry.value.hasPrefix("/") else { throw fail("\(entry.key)= needs an absolute path") }
            path = entry.value
        }
        switch FileSystem.readBytes(path) {
        case let .success(bytes):
            do {
                _ = try TokenCipher(keyMaterial: bytes)
            } catch {
                throw fail("\(entry.key)=: \(error.description)")
            }
            return Secret(String(bytes.map { Character(Unicode.Scalar($0)) }))
        case let .failure(error):
            throw fail("\(entry.key)=: cannot read \(path): \(error)")
        }
    }

    private static func apply(_ entry: INIEntry, to configuration: inout BrokerConfiguration) throws(ConfigError) {
        func fail(_ message: String) -> ConfigError { ConfigError(file: entry.file, line: entry.line, message) }
        switch entry.key {
        case "Socket":
            guard entry.value.hasPrefix("/") else { throw fail("Socket= needs an absolute path") }
            configuration.socketPath = entry.value
        case "SocketMode":
            guard let mode = ConfigValue.mode(entry.value) else { throw fail("SocketMode= needs an octal mode such as 0660") }
            configuration.socketMode = mode
        case "SocketGroup":
            configuration.socketGroup = entry.value.isEmpty ? nil : try group(entry)
        case "AdminGroup":
            configuration.adminGroup = entry.value.isEmpty ? nil : try group(entry)
            if configuration.adminGroup == ProcessDefences.overflowGID { configuration.warnings.append(fail(overflowWarning(entry.key, entry.value))) }
        case "MaxConnections":
            guard let count = Int(entry.value), (1...1_000_000).contains(count) else { throw fail("MaxConnections= needs a number from 1 to 1000000") }
            configuration.maxConnections = count
        case "MaxConnectionsPerUser":
            guard let count = Int(entry.value), (1...1_000_000).contains(count) else { throw fail("MaxConnectionsPerUser= needs a number from 1 to 1000000") }
            configuration.maxConnectionsPerUser = count
        case "MaxMessageSize":
            // At most 1M: parsing is linear, but one message is parsed in one go on the I/O thread
            // (the worst 1M message costs other clients ~45 ms; the default 64K, ~3 ms).
            guard let size = ConfigValue.size(entry.value), (1024...(1 << 20)).contains(size) else {
                throw fail("MaxMessageSize= needs a size from 1K to 1M")
            }
            configuration.maxMessageSize = size
        case "MaxObjectMembers":
            guard let count = Int(entry.value), (16...1_000_000).contains(count) else { throw fail("MaxObjectMembers= needs a number from 16 to 1000000") }
            configuration.maxObjectMembers = count
        case "MessageTimeout":
            guard let timeout = ConfigValue.duration(entry.value), (Duration.milliseconds(100)...Duration.seconds(3600)).contains(timeout) else {
                throw fail("MessageTimeout= needs a time span between 0.1s and 3600s, e.g. 10s")
            }
            configuration.messageTimeout = timeout
        case "MaxQueuedOutput":
            guard let size = ConfigValue.size(entry.value), (64 << 10...(4 << 30)).contains(size) else {
                throw fail("MaxQueuedOutput= needs a size from 64K to 4G")
            }
            configuration.maxQueuedOutput = size
        case "MetricsListen":
            guard !entry.value.isEmpty else {
                configuration.metricsListen = nil
                return
            }
            guard let address = MetricsAddress(entry.value) else {
                throw fail("MetricsListen= needs a loopback address and port (127.0.0.1:9464, [::1]:9464) or an absolute socket path")
            }
            configuration.metricsListen = address
        case "MetricsGroup":
            configuration.metricsGroup = entry.value.isEmpty ? nil : try group(entry)
            if configuration.metricsGroup == ProcessDefences.overflowGID { configuration.warnings.append(fail(overflowWarning(entry.key, entry.value))) }
        case "MetricsBearerTokenFile", "MetricsBearerTokenCredential":
            guard !entry.value.isEmpty else {
                configuration.metricsBearerToken = nil
                return
            }
            var warnings: [ConfigError] = []
            let token = try readSecret(entry, warnings: &warnings)
            // What Prometheus sends as `credentials`: one line of visible ASCII, long enough.
            guard token.reveal.utf8.count >= 16, token.reveal.utf8.count <= 4096,
                  token.reveal.utf8.allSatisfy({ $0 > 0x20 && $0 < 0x7F }) else {
                throw fail("\(entry.key)=: the token must be 16 to 4096 visible ASCII characters (e.g. openssl rand -hex 32)")
            }
            configuration.metricsBearerToken = token
        case "StateKeyFile", "StateKeyCredential":
            guard !entry.value.isEmpty else {
                configuration.stateKey = nil
                return
            }
            configuration.stateKey = try readKey(entry)
        default:
            configuration.warnings.append(fail("unknown key \(entry.key)= in [Broker], ignored"))
        }
    }

    private static func session(_ name: String, origin: INISection, entries: [INIEntry],
                                warnings: inout [ConfigError]) throws(ConfigError) -> SessionConfiguration {
        var kind = "oauth"
        var lifetime = Duration.seconds(3600)
        var users: [UInt32] = []
        var groups: [UInt32] = []
        var policy = RefreshPolicy()
        var oauth = SessionConfiguration.OAuthSettings(client: SessionConfiguration.OAuthClientSettings())
        var secretSources: [INIEntry] = []
        for entry in entries {
            func fail(_ message: String) -> ConfigError { ConfigError(file: entry.file, line: entry.line, message) }
            func duration(_ range: ClosedRange<Duration>) throws(ConfigError) -> Duration { try durationValue(entry, range) }
            func url() throws(ConfigError) -> String? {
                guard !entry.value.isEmpty else { return nil }
                if let problem = EndpointPolicy.problemBeforeLibcurl(with: entry.value) { throw fail("\(entry.key)=: \(problem)") }
                return entry.value
            }
            /// An allow list: an empty value clears it, each word adds a name or a number.
            func allow(_ ids: inout [UInt32], _ lookup: (String) -> UInt32?, overflow: UInt32) throws(ConfigError) {
                if entry.value.isEmpty { ids = [] }
                for word in ConfigValue.list(entry.value) {
                    let id = try resolve(word, entry, lookup)
                    if id == overflow { warnings.append(fail(overflowWarning(entry.key, word))) }
                    ids.append(id)
                }
            }
            func file() throws(ConfigError) -> String? { try readableFile(entry) }
            switch entry.key {
            case "Name":
                break
            case "Fleet":
                guard ConfigValue.bool(entry.value) != nil else { throw fail("Fleet= must be yes or no") }
            case "Upstream":
                guard entry.value == "oauth" || entry.value == "test" else { throw fail("Upstream= must be 'oauth' or 'test'") }
                kind = entry.value
            case "TestTokenLifetime":
                lifetime = try duration(.seconds(1)...Duration.seconds(86400 * 30))
            case "Grant":
                guard let grant = OAuthGrant(rawValue: entry.value) else { throw fail("Grant= must be refresh_token or client_credentials") }
                oauth.grant = grant
            case "Issuer":
                oauth.issuer = try url()
            case "TokenEndpoint":
                oauth.tokenEndpoint = try url()
            case "RevocationEndpoint":
                oauth.revocationEndpoint = try url()
            case "DeviceAuthorizationEndpoint":
                oauth.deviceAuthorizationEndpoint = try url()
            case "ClientID":
                oauth.client.clientID = entry.value
            case "ClientSecretFile", "ClientSecretCredential", "ClientSecret":
                secretSources.append(entry)
            case "ClientAuthentication":
                guard let method = ClientAuthentication(rawValue: entry.value) else {
                    throw fail("ClientAuthentication= must be client_secret_basic, client_secret_post or none")
                }
                oauth.client.authentication = method
            case "Scope":
                oauth.client.scope = entry.value.isEmpty ? nil : entry.value
            case "CAFile":
                oauth.client.tls.caFile = try file()
            case "ClientCertificate":
                oauth.client.tls.clientCertificate = try file()
            case "ClientKey":
                oauth.client.tls.clientKey = try file()
            case "ConnectTimeout":
                oauth.client.connectTimeout = try duration(.milliseconds(100)...Duration.seconds(300))
            case "RequestTimeout":
                oauth.client.timeout = try duration(.milliseconds(100)...Duration.seconds(600))
            case "RevokeOnLogout":
                guard let value = ConfigValue.bool(entry.value) else { throw fail("RevokeOnLogout= must be yes or no") }
                oauth.revokeOnLogout = value
            case "AllowUsers":
                try allow(&users, Identity.userID, overflow: ProcessDefences.overflowUID)
            case "AllowGroups":
                try allow(&groups, Identity.groupID, overflow: ProcessDefences.overflowGID)
            case "RefreshAhead":
                policy.refreshAhead = try duration(.zero...Duration.seconds(86400))
            case "RefreshLimitBurst":
                guard let burst = Int(entry.value), (1...10_000).contains(burst) else { throw fail("RefreshLimitBurst= needs a number from 1 to 10000") }
                policy.guardLimit = burst
            case "RefreshLimitInterval":
                policy.guardWindow = try duration(.seconds(1)...Duration.seconds(86400))
            case "BackoffInitial":
                policy.backoff.initial = try duration(.milliseconds(10)...Duration.seconds(3600))
            case "BackoffMax":
                policy.backoff.maximum = try duration(.milliseconds(10)...Duration.seconds(86400))
            default:
                warnings.append(fail("unknown key \(entry.key)= in [Session] \(name), ignored"))
            }
        }
        if policy.backoff.maximum < policy.backoff.initial, let entry = entries.last(where: { $0.key == "BackoffMax" }) {
            throw ConfigError(file: entry.file, line: entry.line, "BackoffMax= is shorter than BackoffInitial=")
        }
        let upstream: SessionConfiguration.Upstream
        if kind == "test" {
            upstream = .test(lifetime: lifetime)
        } else {
            guard !oauth.client.clientID.isEmpty else {
                throw ConfigError(file: origin.file, line: origin.line, "[Session] \(name) needs ClientID= (or Upstream=test)")
            }
            guard oauth.issuer != nil || oauth.tokenEndpoint != nil else {
                throw ConfigError(file: origin.file, line: origin.line, "[Session] \(name) needs TokenEndpoint= or Issuer=")
            }
            if (oauth.client.tls.clientCertificate == nil) != (oauth.client.tls.clientKey == nil),
               let entry = entries.last(where: { $0.key == "ClientCertificate" || $0.key == "ClientKey" }) {
                throw ConfigError(file: entry.file, line: entry.line, "ClientCertificate= and ClientKey= go together")
            }
            if let source = secretSources.last {
                oauth.client.clientSecret = try readSecret(source, warnings: &warnings)
            } else if oauth.client.authentication != .none {
                throw ConfigError(file: origin.file, line: origin.line,
                                  "[Session] \(name) needs ClientSecretFile= or ClientSecretCredential= (or ClientAuthentication=none)")
            }
            upstream = .oauth(oauth)
        }
        return SessionConfiguration(name: name, upstream: upstream, allowUsers: users, allowGroups: groups,
                                    policy: policy, origin: "\(origin.file):\(origin.line)")
    }

    /// A client secret from a file, a systemd credential (`$CREDENTIALS_DIRECTORY/NAME`), or —
    /// discouraged, with a warning — the configuration itself. Trailing newlines are dropped.
    private static func readSecret(_ entry: INIEntry, warnings: inout [ConfigError]) throws(ConfigError) -> Secret {
        func fail(_ message: String) -> ConfigError { ConfigError(file: entry.file, line: entry.line, message) }
        let path: String
        switch entry.key {
        case "ClientSecret":
            warnings.append(fail("ClientSecret= puts a secret in a configuration file that may be world-readable; "
                                 + "use ClientSecretFile= or ClientSecretCredential= (LoadCredential=) instead"))
            guard !entry.value.isEmpty else { throw fail("ClientSecret= is empty") }
            return Secret(entry.value)
        case "ClientSecretCredential", "MetricsBearerTokenCredential":
            guard let directory = getenv("CREDENTIALS_DIRECTORY").map({ String(cString: $0) }) else {
                throw fail("\(entry.key)=: $CREDENTIALS_DIRECTORY is not set (use LoadCredential= in the unit)")
            }
            guard !entry.value.isEmpty, !entry.value.contains("/") else { throw fail("\(entry.key)= needs a credential name") }
            path = directory + "/" + entry.value
        default:
            guard entry.value.hasPrefix("/") else { throw fail("\(entry.key)= needs an absolute path") }
            path = entry.value
        }
        switch FileSystem.readText(path) {
        case let .success(text):
            var secret = Substring(text)
            while let last = secret.last, last == "\n" || last == "\r" { secret = secret.dropLast() }
            guard !secret.isEmpty else { throw fail("\(entry.key)=: \(path) is empty") }
            return Secret(String(secret))
        case let .failure(error):
            throw fail("\(entry.key)=: cannot read \(path): \(error)")
        }
    }

    /// Why an overflow id in an allow list is ignored (see `Access`).
    private static func overflowWarning(_ key: String, _ word: String) -> String {
        "\(key)=: '\(word)' is the kernel's overflow id, which stands for any unmapped peer; it never matches"
    }

    private static func group(_ entry: INIEntry) throws(ConfigError) -> UInt32 {
        try resolve(entry.value, entry, Identity.groupID)
    }

    private static func resolve(_ word: String, _ entry: INIEntry, _ lookup: (String) -> UInt32?) throws(ConfigError) -> UInt32 {
        if let id = UInt32(word) { return id }
        guard let id = lookup(word) else {
            throw ConfigError(file: entry.file, line: entry.line, "\(entry.key)=: no such \(entry.key.contains("User") ? "user" : "group") '\(word)'")
        }
        return id
    }
}
