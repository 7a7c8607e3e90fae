#if canImport(Glibc)
import Glibc
#endif
import Sealing
import TokenBrokerCore
import Upstream
import Varlink

/// What a change of a key does to a running daemon.
public enum ConfigChange: Sendable, Equatable, CustomStringConvertible {
    /// A reload builds the session a new coordinator, which takes the old one's state over.
    case rebuildsSession
    /// A reload applies it to the running session (its tokens and flights stay).
    case keepsSession
    /// A reload applies it.
    case atReload
    /// Read at start only: a reload keeps the value in force.
    case atStart

    public var description: String {
        switch self {
        case .rebuildsSession: "a reload rebuilds the session (its state carried over)"
        case .keepsSession, .atReload: "a reload applies it"
        case .atStart: "read at start only"
        }
    }
}

/// One configuration key, declared once: its section and name, what value it takes, its
/// default, one line of documentation, what a change does at a reload, how its value is read
/// (with its range: every bad value is an error at `file:line`), and whether two settings agree
/// on it. Parsing, reload equality, `check-config --keys` and the documentation test all
/// follow from the tables in `ConfigSchema`.
public struct ConfigKey<Settings: Sendable>: Sendable {
    public let name: String
    /// What it takes, for people: "a time span from 0s to 24h".
    public let takes: String
    /// The default, as written in the configuration ("" when there is none).
    public let defaultValue: String
    public let summary: String
    public let change: ConfigChange
    let apply: @Sendable (inout Settings, INIEntry, inout ConfigContext) throws(ConfigError) -> Void
    let same: @Sendable (Settings, Settings) -> Bool

    init(_ name: String, takes: String, default defaultValue: String = "", change: ConfigChange, _ summary: String,
         same: @escaping @Sendable (Settings, Settings) -> Bool,
         apply: @escaping @Sendable (inout Settings, INIEntry, inout ConfigContext) throws(ConfigError) -> Void) {
        self.name = name
        self.takes = takes
        self.defaultValue = defaultValue
        self.summary = summary
        self.change = change
        self.same = same
        self.apply = apply
    }

    /// A key whose value, read by `parse`, is stored at `path`.
    ///
    /// The key path is made where it is first used, not with the table: a key path literal is
    /// instantiated by the runtime at its first evaluation (24,000 instructions each; the
    /// tables' 53 were a sixth of a start) and kept, so later evaluations are a load and a
    /// retain. A configuration names a few keys; a reload's comparison makes the rest.
    init<Value: Equatable & Sendable>(_ name: String, _ path: @autoclosure @escaping @Sendable () -> WritableKeyPath<Settings, Value>,
                                      _ parse: ConfigParser<Value>, default defaultValue: String = "", change: ConfigChange, _ summary: String) {
        self.init(name, takes: parse.takes, default: defaultValue, change: change, summary,
                  same: { let path = path(); return $0[keyPath: path] == $1[keyPath: path] },
                  apply: { (settings: inout Settings, entry: INIEntry, context: inout ConfigContext) throws(ConfigError) in
                      settings[keyPath: path()] = try parse.read(entry, &context)
                  })
    }
}

/// What reading a configuration carries from key to key: its warnings, and the user and group
/// names looked up so far (a host with thousands of sessions names the same groups often).
public struct ConfigContext {
    var warnings: [ConfigError] = []
    /// The errors so far (at most `ConfigError.most`; `omittedErrors` counts the rest).
    private(set) var errors: [ConfigError] = []
    private(set) var omittedErrors = 0
    private var users: [String: UInt32?] = [:]
    private var groups: [String: UInt32?] = [:]

    mutating func userID(_ name: String) -> UInt32? {
        if let known = users[name] { return known }
        let id = Identity.userID(name)
        users[name] = id
        return id
    }

    mutating func groupID(_ name: String) -> UInt32? {
        if let known = groups[name] { return known }
        let id = Identity.groupID(name)
        groups[name] = id
        return id
    }

    mutating func record(_ error: ConfigError) {
        // (A combined error's own parts, each counted.)
        for one in [error] + error.further {
            var plain = one
            plain.further = []
            plain.warnings = []
            if errors.count < ConfigError.most { errors.append(plain) } else { omittedErrors += 1 }
        }
        omittedErrors += error.omitted
    }

    mutating func warn(_ entry: INIEntry, _ message: String) {
        warnings.append(ConfigError(file: entry.file, line: entry.line, message))
    }
}

/// How one kind of value is read, and what it takes, for people.
public struct ConfigParser<Value: Sendable>: Sendable {
    let takes: String
    let read: @Sendable (INIEntry, inout ConfigContext) throws(ConfigError) -> Value
}

func fail(_ entry: INIEntry, _ message: String) -> ConfigError {
    ConfigError(file: entry.file, line: entry.line, message)
}

extension ConfigParser {
    /// A time span within `range`.
    static func duration(_ range: ClosedRange<Duration>, message: String? = nil) -> ConfigParser<Duration> {
        ConfigParser<Duration>(takes: "a time span from \(describe(range.lowerBound)) to \(describe(range.upperBound))") {
            (entry: INIEntry, _: inout ConfigContext) throws(ConfigError) -> Duration in
            guard let value = ConfigValue.duration(entry.value), range.contains(value) else {
                throw fail(entry, message ?? "\(entry.key)= needs a time span between \(range.lowerBound.seconds)s and "
                           + "\(range.upperBound.seconds)s, e.g. 60s or 5min")
            }
            return value
        }
    }

    /// A whole number within `range`.
    static func count(_ range: ClosedRange<Int>) -> ConfigParser<Int> {
        ConfigParser<Int>(takes: "a number from \(range.lowerBound) to \(range.upperBound)") {
            (entry: INIEntry, _: inout ConfigContext) throws(ConfigError) -> Int in
            guard let count = Int(entry.value), range.contains(count) else {
                throw fail(entry, "\(entry.key)= needs a number from \(range.lowerBound) to \(range.upperBound)")
            }
            return count
        }
    }

    /// A size (K, M, G suffixes) within `range`, said as `text` ("1K to 1M").
    static func size(_ range: ClosedRange<Int>, _ text: String) -> ConfigParser<Int> {
        ConfigParser<Int>(takes: "a size from \(text)") { (entry: INIEntry, _: inout ConfigContext) throws(ConfigError) -> Int in
            guard let size = ConfigValue.size(entry.value), range.contains(size) else { throw fail(entry, "\(entry.key)= needs a size from \(text)") }
            return size
        }
    }

    static var bool: ConfigParser<Bool> {
        ConfigParser<Bool>(takes: "yes or no") { (entry: INIEntry, _: inout ConfigContext) throws(ConfigError) -> Bool in
            guard let value = ConfigValue.bool(entry.value) else { throw fail(entry, "\(entry.key)= must be yes or no") }
            return value
        }
    }

    /// Any text; empty is none.
    static var text: ConfigParser<String?> {
        ConfigParser<String?>(takes: "text") { (entry: INIEntry, _: inout ConfigContext) throws(ConfigError) -> String? in
            entry.value.isEmpty ? nil : entry.value
        }
    }

    /// One of `values` (by their raw text).
    static func oneOf<Choice: RawRepresentable & Sendable>(_ type: Choice.Type, _ values: [Choice], message: String)
        -> ConfigParser<Choice> where Choice.RawValue == String {
        ConfigParser<Choice>(takes: values.map(\.rawValue).joined(separator: ", ")) {
            (entry: INIEntry, _: inout ConfigContext) throws(ConfigError) -> Choice in
            guard let choice = Choice(rawValue: entry.value), values.contains(where: { $0.rawValue == choice.rawValue }) else {
                throw fail(entry, message)
            }
            return choice
        }
    }

    /// A URL the daemon may send a credential to (empty: none).
    static var url: ConfigParser<String?> {
        ConfigParser<String?>(takes: "an https:// URL (http:// to loopback only)") {
            (entry: INIEntry, _: inout ConfigContext) throws(ConfigError) -> String? in
            guard !entry.value.isEmpty else { return nil }
            if let problem = EndpointPolicy.problemBeforeLibcurl(with: entry.value) { throw fail(entry, "\(entry.key)=: \(problem)") }
            return entry.value
        }
    }

    /// A readable file by absolute path (empty: none).
    static var file: ConfigParser<String?> {
        ConfigParser<String?>(takes: "an absolute path to a readable file") {
            (entry: INIEntry, _: inout ConfigContext) throws(ConfigError) -> String? in
            guard !entry.value.isEmpty else { return nil }
            guard entry.value.hasPrefix("/") else { throw fail(entry, "\(entry.key)= needs an absolute path") }
            guard access(entry.value, R_OK) == 0 else { throw fail(entry, "\(entry.key)=: cannot read \(entry.value)") }
            return entry.value
        }
    }

    /// A readable file holding a secret, such as a TLS private key (empty: none): readable by
    /// every user is an error, by its group a warning (`SecretFileAccess`).
    static var secretFile: ConfigParser<String?> {
        ConfigParser<String?>(takes: "an absolute path to a file only the daemon's user reads") {
            (entry: INIEntry, context: inout ConfigContext) throws(ConfigError) -> String? in
            guard let path = try file.read(entry, &context) else { return nil }
            var info = stat()
            guard stat(path, &info) == 0 else { throw fail(entry, "\(entry.key)=: cannot read \(path)") }
            try ConfigParsing.check(SecretFileAccess(info), of: path, entry, &context)
            return path
        }
    }

    /// A group by name or number (empty: none); the kernel's overflow gid warns.
    static var group: ConfigParser<UInt32?> {
        ConfigParser<UInt32?>(takes: "a group name or gid") { (entry: INIEntry, context: inout ConfigContext) throws(ConfigError) -> UInt32? in
            guard !entry.value.isEmpty else { return nil }
            let id = try resolve(entry.value, entry) { context.groupID($0) }
            if id == ProcessDefences.overflowGID { context.warn(entry, overflowWarning(entry.key, entry.value)) }
            return id
        }
    }

    /// A user by name or number (empty: none); the kernel's overflow uid warns.
    static var user: ConfigParser<UInt32?> {
        ConfigParser<UInt32?>(takes: "a user name or uid") { (entry: INIEntry, context: inout ConfigContext) throws(ConfigError) -> UInt32? in
            guard !entry.value.isEmpty else { return nil }
            let id = try resolve(entry.value, entry) { context.userID($0) }
            if id == ProcessDefences.overflowUID { context.warn(entry, overflowWarning(entry.key, entry.value)) }
            return id
        }
    }

    /// A 32-byte key from a file or a systemd credential (empty: none).
    static var key: ConfigParser<SecretBytes?> {
        ConfigParser<SecretBytes?>(takes: "a file or credential holding 32 bytes or 64 hex digits") { (entry: INIEntry, context: inout ConfigContext) throws(ConfigError) -> SecretBytes? in
            entry.value.isEmpty ? nil : try ConfigParsing.readKey(entry, &context)
        }
    }
}

/// Reading the values that need more than one line.
enum ConfigParsing {
    /// The most ports a port list (`LoginRedirectPorts=`) may name, ranges counted in full.
    static let mostPorts = 1024

    /// Ports (1-65535) and ranges (`8400-8409`), space-separated, in order, each once; empty: none.
    static func ports(_ entry: INIEntry) throws(ConfigError) -> [UInt16] {
        var ports: [UInt16] = []
        var seen = Set<UInt16>()
        for word in ConfigValue.list(entry.value) {
            let bounds = word.split(separator: "-", maxSplits: 1, omittingEmptySubsequences: false)
            guard let low = UInt16(bounds[0]), low > 0, let high = bounds.count == 2 ? UInt16(bounds[1]) : low, high >= low else {
                throw fail(entry, "\(entry.key)=: '\(word)' is not a port or a range of ports (1-65535, e.g. 8400 or 8400-8409)")
            }
            guard ports.count + Int(high - low) + 1 <= mostPorts else { throw fail(entry, "\(entry.key)= names more than \(mostPorts) ports") }
            for port in low...high where seen.insert(port).inserted { ports.append(port) }
        }
        return ports
    }

    /// A 32-byte key (`StateKey…=`, `[Fleet] Key…=`) from a file or a systemd credential,
    /// checked, kept as the bytes read.
    static func readKey(_ entry: INIEntry, _ context: inout ConfigContext) throws(ConfigError) -> SecretBytes {
        let path: String
        if entry.key.hasSuffix("Credential") {
            guard let directory = getenv("CREDENTIALS_DIRECTORY").map({ String(cString: $0) }) else {
                throw fail(entry, "\(entry.key)=: $CREDENTIALS_DIRECTORY is not set (use LoadCredential= in the unit)")
            }
            guard !entry.value.contains("/") else { throw fail(entry, "\(entry.key)= needs a credential name") }
            path = directory + "/" + entry.value
        } else {
            guard entry.value.hasPrefix("/") else { throw fail(entry, "\(entry.key)= needs an absolute path") }
            path = entry.value
        }
        switch try read(path, entry, &context) {
        case let .success(bytes):
            do {
                _ = try TokenCipher(keyMaterial: bytes)
            } catch {
                throw fail(entry, "\(entry.key)=: \(error.description)")
            }
            return SecretBytes(bytes)
        case let .failure(error):
            throw fail(entry, "\(entry.key)=: cannot read \(path): \(error)")
        }
    }

    /// A secret from a file, a systemd credential (`$CREDENTIALS_DIRECTORY/NAME`), or —
    /// discouraged, with a warning — the configuration itself. Trailing newlines are dropped.
    static func readSecret(_ entry: INIEntry, _ context: inout ConfigContext) throws(ConfigError) -> Secret {
        let path: String
        switch entry.key {
        case "ClientSecret":
            context.warn(entry, "ClientSecret= puts a secret in a configuration file that may be world-readable; "
                         + "use ClientSecretFile= or ClientSecretCredential= (LoadCredential=) instead")
            guard !entry.value.isEmpty else { throw fail(entry, "ClientSecret= is empty") }
            return Secret(entry.value)
        case "ClientSecretCredential", "MetricsBearerTokenCredential", "ClientKeyCredential":
            guard let directory = getenv("CREDENTIALS_DIRECTORY").map({ String(cString: $0) }) else {
                throw fail(entry, "\(entry.key)=: $CREDENTIALS_DIRECTORY is not set (use LoadCredential= in the unit)")
            }
            guard !entry.value.isEmpty, !entry.value.contains("/") else { throw fail(entry, "\(entry.key)= needs a credential name") }
            path = directory + "/" + entry.value
        default:
            guard entry.value.hasPrefix("/") else { throw fail(entry, "\(entry.key)= needs an absolute path") }
            path = entry.value
        }
        switch try read(path, entry, &context).map({ String(decoding: $0, as: UTF8.self) }) {
        case let .success(text):
            var secret = Substring(text)
            while let last = secret.last, last == "\n" || last == "\r" { secret = secret.dropLast() }
            guard !secret.isEmpty else { throw fail(entry, "\(entry.key)=: \(path) is empty") }
            return Secret(String(secret))
        case let .failure(error):
            throw fail(entry, "\(entry.key)=: cannot read \(path): \(error)")
        }
    }
}

extension ConfigParsing {
    /// A secret from `path`: a `…File=` key's file is checked for who may read it (refused when
    /// anyone may, a warning when its group may); a systemd credential is systemd's to guard.
    fileprivate static func read(_ path: String, _ entry: INIEntry, _ context: inout ConfigContext) throws(ConfigError)
        -> Result<[UInt8], SocketError> {
        guard !entry.key.hasSuffix("Credential") else { return FileSystem.readBytes(path) }
        switch FileSystem.readSecret(path) {
        case let .success(file):
            try check(file.access, of: path, entry, &context)
            return .success(file.bytes)
        case let .failure(error):
            return .failure(error)
        }
    }

    /// Refuses a secret file every user may read; warns about one its group may.
    static func check(_ access: SecretFileAccess, of path: String, _ entry: INIEntry, _ context: inout ConfigContext) throws(ConfigError) {
        if let refusal = access.refusal(path) { throw fail(entry, "\(entry.key)=: \(refusal)") }
        if let warning = access.warning(path) { context.warn(entry, "\(entry.key)=: \(warning)") }
    }
}

/// Why an overflow id in an allow list is ignored (see `Access`).
func overflowWarning(_ key: String, _ word: String) -> String {
    "\(key)=: '\(word)' is the kernel's overflow id, which stands for any unmapped peer; it never matches"
}

/// A user or group by number, or by name through `lookup`.
func resolve(_ word: String, _ entry: INIEntry, _ lookup: (String) -> UInt32?) throws(ConfigError) -> UInt32 {
    if let id = UInt32(word) { return id }
    guard let id = lookup(word) else {
        throw fail(entry, "\(entry.key)=: no such \(entry.key.contains("User") ? "user" : "group") '\(word)'")
    }
    return id
}

/// A span for people: 100ms, 5s, 90min, 24h, 30d.
private func describe(_ duration: Duration) -> String {
    let milliseconds = duration.components.seconds * 1000 + duration.components.attoseconds / 1_000_000_000_000_000
    if milliseconds % 1000 != 0 { return "\(milliseconds)ms" }
    let seconds = milliseconds / 1000
    for (unit, size) in [("d", Int64(86400)), ("h", 3600), ("min", 60)] where seconds >= size && seconds % size == 0 {
        return "\(seconds / size)\(unit)"
    }
    return "\(seconds)s"
}
