#if canImport(Glibc)
import Glibc
#endif
import TokenBrokerCore

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
        for section in sections {
            switch section.name {
            case "Broker":
                for entry in section.entries { try apply(entry, to: &configuration) }
            case "Session":
                guard let nameEntry = section.entries.last(where: { $0.key == "Name" }) else {
                    throw ConfigError(file: section.file, line: section.line, "[Session] needs Name=")
                }
                guard ConfigValue.isSessionName(nameEntry.value) else {
                    throw ConfigError(file: nameEntry.file, line: nameEntry.line,
                                      "invalid session name '\(nameEntry.value)' (1-64 of A-Z a-z 0-9 - _ .)")
                }
                if let index = sessionEntries.firstIndex(where: { $0.name == nameEntry.value }) {
                    sessionEntries[index].entries += section.entries
                } else {
                    sessionEntries.append((nameEntry.value, section, section.entries))
                }
            default:
                configuration.warnings.append(ConfigError(file: section.file, line: section.line, "unknown section [\(section.name)], ignored"))
            }
        }
        for (name, origin, entries) in sessionEntries {
            configuration.sessions.append(try session(name, origin: origin, entries: entries, warnings: &configuration.warnings))
        }
        return configuration
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
        case "MaxConnections":
            guard let count = Int(entry.value), (1...1_000_000).contains(count) else { throw fail("MaxConnections= needs a number from 1 to 1000000") }
            configuration.maxConnections = count
        case "MaxMessageSize":
            guard let size = ConfigValue.size(entry.value), (1024...(64 << 20)).contains(size) else {
                throw fail("MaxMessageSize= needs a size from 1K to 64M")
            }
            configuration.maxMessageSize = size
        default:
            configuration.warnings.append(fail("unknown key \(entry.key)= in [Broker], ignored"))
        }
    }

    private static func session(_ name: String, origin: INISection, entries: [INIEntry],
                                warnings: inout [ConfigError]) throws(ConfigError) -> SessionConfiguration {
        var upstream: String?
        var upstreamEntry: INIEntry?
        var lifetime = Duration.seconds(3600)
        var users: [UInt32] = []
        var groups: [UInt32] = []
        var policy = RefreshPolicy()
        for entry in entries {
            func fail(_ message: String) -> ConfigError { ConfigError(file: entry.file, line: entry.line, message) }
            func duration(_ range: ClosedRange<Duration>) throws(ConfigError) -> Duration {
                guard let value = ConfigValue.duration(entry.value), range.contains(value) else {
                    throw fail("\(entry.key)= needs a time span between \(range.lowerBound.seconds)s and \(range.upperBound.seconds)s, e.g. 60s or 5min")
                }
                return value
            }
            switch entry.key {
            case "Name":
                break
            case "Upstream":
                guard entry.value == "test" else {
                    throw fail("Upstream= must be 'test' (OAuth upstreams are not supported by this build yet)")
                }
                upstream = entry.value
                upstreamEntry = entry
            case "TestTokenLifetime":
                lifetime = try duration(.seconds(1)...Duration.seconds(86400 * 30))
            case "AllowUsers":
                if entry.value.isEmpty { users = [] }
                for word in ConfigValue.list(entry.value) { users.append(try resolve(word, entry, Identity.userID)) }
            case "AllowGroups":
                if entry.value.isEmpty { groups = [] }
                for word in ConfigValue.list(entry.value) { groups.append(try resolve(word, entry, Identity.groupID)) }
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
        guard upstream != nil else {
            throw ConfigError(file: origin.file, line: origin.line, "[Session] \(name) needs Upstream=")
        }
        if policy.backoff.maximum < policy.backoff.initial, let entry = entries.last(where: { $0.key == "BackoffMax" }) ?? upstreamEntry {
            throw ConfigError(file: entry.file, line: entry.line, "BackoffMax= is shorter than BackoffInitial=")
        }
        return SessionConfiguration(name: name, upstream: .test(lifetime: lifetime), allowUsers: users, allowGroups: groups,
                                    policy: policy, origin: "\(origin.file):\(origin.line)")
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
