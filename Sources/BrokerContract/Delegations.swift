import Varlink

/// How a token file holds its token (`[Output]` `Format=`, `ctl delegate --format`).
public enum TokenFileFormat: String, Sendable, Equatable, CaseIterable {
    /// The bare token and a newline (the WLCG `BEARER_TOKEN_FILE` convention).
    case token
    /// One HTTP header line: `Authorization: Bearer <token>`.
    case header
    /// `{"access_token":…,"token_type":…,"expires_at":…,"serial":…}` and a newline.
    case json
}

/// `Delegate`'s parameters: chosen sessions on a socket of their own, or one session's token in
/// a file kept fresh, or both, made at run time by an admin (`tokenbroker ctl delegate`).
/// Bounded as a `[Delegation]` or `[Output]` section is.
public struct DelegationRequest: Sendable, Equatable {
    /// Its name; the daemon picks one when none is given.
    public var name: String?
    public var sessions: [String]
    /// Where its socket is bound (nil: no socket; then `file` is given).
    public var socket: String?
    /// Where the token file is kept (nil: none); it needs exactly one session.
    public var file: String?
    public var format: TokenFileFormat?
    /// Users (by uid) who may read the file besides its owner (a POSIX ACL entry each).
    public var readers: [UInt32]
    /// The file's mode (0600 by default; read bits and its owner's write bit only).
    public var fileMode: UInt32?
    /// Seconds until it ends by itself (1 to a year); nil: until `Undelegate`.
    public var ttl: Int64?
    /// The socket file's mode, owner and group (0660, the daemon's user and group by default).
    public var mode: UInt32?
    public var user: UInt32?
    public var group: UInt32?
    /// Only these peers (by the kernel's ids) may use it; both empty: whoever opens the socket.
    public var allowUsers: [UInt32]
    public var allowGroups: [UInt32]
    public var maxConnections: Int?

    public init(name: String? = nil, sessions: [String], socket: String?, file: String? = nil, format: TokenFileFormat? = nil,
                readers: [UInt32] = [], ttl: Int64? = nil, mode: UInt32? = nil, user: UInt32? = nil,
                group: UInt32? = nil, allowUsers: [UInt32] = [], allowGroups: [UInt32] = [], maxConnections: Int? = nil) {
        (self.name, self.sessions, self.socket, self.ttl) = (name, sessions, socket, ttl)
        (self.file, self.format, self.readers) = (file, format, readers)
        (self.mode, self.user, self.group) = (mode, user, group)
        (self.allowUsers, self.allowGroups, self.maxConnections) = (allowUsers, allowGroups, maxConnections)
    }

    static let fields: [String] = ["name", "sessions", "socket", "file", "format", "readers", "fileMode", "ttl", "mode", "user", "group", "allowUsers",
                                      "allowGroups", "maxConnections"]

    /// Reads and bounds the parameters (the daemon checks what only it can: the sessions, the path).
    init(_ parameters: Parameters) throws(ParameterError) {
        try parameters.only(Self.fields)
        name = try parameters.optionalString("name")
        if let name, !BrokerContract.isName(name) { throw ParameterError(name: "name") }
        sessions = try Self.strings(parameters, "sessions", limit: 256) { BrokerContract.isName($0) }
        guard !sessions.isEmpty else { throw ParameterError(name: "sessions") }
        socket = try parameters.optionalString("socket")
        if let socket, !Self.isPath(socket, limit: 107) { throw ParameterError(name: "socket") }
        file = try parameters.optionalString("file")
        if let file, !Self.isPath(file, limit: 4095) { throw ParameterError(name: "file") }
        // A file holds one session's token; a delegation has a socket, a file or both.
        if file != nil, sessions.count != 1 { throw ParameterError(name: "sessions") }
        if socket == nil, file == nil { throw ParameterError(name: "socket") }
        switch parameters.object["format"] {
        case nil, .null?: format = nil
        case let value?:
            guard file != nil, let text = value.stringValue, let format = TokenFileFormat(rawValue: text) else { throw ParameterError(name: "format") }
            self.format = format
        }
        readers = try Self.ids(parameters, "readers")
        if !readers.isEmpty, file == nil { throw ParameterError(name: "readers") }
        fileMode = try Self.optionalInt(parameters, "fileMode", 0...0o644).map { UInt32($0) }
        if let fileMode, file == nil || fileMode & ~0o644 != 0 { throw ParameterError(name: "fileMode") }
        ttl = try Self.optionalInt(parameters, "ttl", 1...31_536_000)
        mode = try Self.optionalInt(parameters, "mode", 0...0o777).map { UInt32($0) }
        user = try Self.optionalInt(parameters, "user", 0...Int64(UInt32.max - 1)).map { UInt32($0) }
        group = try Self.optionalInt(parameters, "group", 0...Int64(UInt32.max - 1)).map { UInt32($0) }
        allowUsers = try Self.ids(parameters, "allowUsers")
        allowGroups = try Self.ids(parameters, "allowGroups")
        maxConnections = try Self.optionalInt(parameters, "maxConnections", 1...65_536).map { Int($0) }
    }

    var parameters: JSONObject {
        var parameters: JSONObject = ["sessions": .array(sessions.map(JSON.string))]
        if let socket { parameters["socket"] = .string(socket) }
        if let file { parameters["file"] = .string(file) }
        if let format { parameters["format"] = .string(format.rawValue) }
        if !readers.isEmpty { parameters["readers"] = .array(readers.map { .int(Int64($0)) }) }
        if let fileMode { parameters["fileMode"] = .int(Int64(fileMode)) }
        if let name { parameters["name"] = .string(name) }
        if let ttl { parameters["ttl"] = .int(ttl) }
        if let mode { parameters["mode"] = .int(Int64(mode)) }
        if let user { parameters["user"] = .int(Int64(user)) }
        if let group { parameters["group"] = .int(Int64(group)) }
        if !allowUsers.isEmpty { parameters["allowUsers"] = .array(allowUsers.map { .int(Int64($0)) }) }
        if !allowGroups.isEmpty { parameters["allowGroups"] = .array(allowGroups.map { .int(Int64($0)) }) }
        if let maxConnections { parameters["maxConnections"] = .int(Int64(maxConnections)) }
        return parameters
    }

    /// An absolute path of visible ASCII of at most `limit` bytes.
    private static func isPath(_ path: String, limit: Int) -> Bool {
        path.hasPrefix("/") && (2...limit).contains(path.utf8.count) && path.utf8.allSatisfy { $0 > 0x20 && $0 < 0x7F }
    }

    private static func optionalInt(_ parameters: Parameters, _ name: String, _ range: ClosedRange<Int64>) throws(ParameterError) -> Int64? {
        switch parameters.object[name] {
        case nil, .null?: return nil
        case let value?:
            guard let number = value.intValue, range.contains(number) else { throw ParameterError(name: name) }
            return number
        }
    }

    private static func strings(_ parameters: Parameters, _ name: String, limit: Int, _ valid: (String) -> Bool) throws(ParameterError) -> [String] {
        guard let array = parameters.object[name]?.arrayValue, array.count <= limit else { throw ParameterError(name: name) }
        var result: [String] = []
        for element in array {
            guard let text = element.stringValue, valid(text) else { throw ParameterError(name: name) }
            if !result.contains(text) { result.append(text) }
        }
        return result
    }

    private static func ids(_ parameters: Parameters, _ name: String) throws(ParameterError) -> [UInt32] {
        switch parameters.object[name] {
        case nil, .null?: return []
        case let .array(array)? where array.count <= 256:
            var result: [UInt32] = []
            for element in array {
                guard let number = element.intValue, let id = UInt32(exactly: number), id != UInt32.max else { throw ParameterError(name: name) }
                result.append(id)
            }
            return result
        default: throw ParameterError(name: name)
        }
    }
}

/// One delegation or token file, as `Delegations` lists it (no token, no peer).
public struct DelegationInfo: Sendable, Equatable {
    public var name: String
    public var sessions: [String]
    /// Its socket, its token file: either or both.
    public var socket: String?
    public var file: String?
    public var expiresAt: Int64?
    /// From a `[Delegation]` or `[Output]` section (a reload changes it), or made at run time.
    public var configured: Bool
    /// What went wrong with its file, if anything now (the file is then absent).
    public var problem: String?

    public init(name: String, sessions: [String], socket: String?, file: String? = nil, expiresAt: Int64?, configured: Bool,
                problem: String? = nil) {
        (self.name, self.sessions, self.socket, self.file, self.expiresAt) = (name, sessions, socket, file, expiresAt)
        (self.configured, self.problem) = (configured, problem)
    }

    public init?(_ object: JSONObject) {
        guard let name = object["name"]?.stringValue else { return nil }
        self.init(name: name, sessions: (object["sessions"]?.arrayValue ?? []).prefix(256).compactMap(\.stringValue),
                  socket: object["socket"]?.stringValue.flatMap { $0.isEmpty ? nil : $0 }, file: object["file"]?.stringValue, expiresAt: object["expiresAt"]?.intValue,
                  configured: object["configured"]?.boolValue ?? false, problem: object["problem"]?.stringValue)
    }

    public var parameters: JSONObject {
        // (`socket` was always there: empty when it has none, for clients that expect it.)
        var object: JSONObject = ["name": .string(name), "sessions": .array(sessions.map(JSON.string)), "socket": .string(socket ?? ""),
                                  "configured": .bool(configured)]
        if let file { object["file"] = .string(file) }
        if let expiresAt { object["expiresAt"] = .int(expiresAt) }
        if let problem { object["problem"] = .string(problem) }
        return object
    }
}

extension BrokerContract {
    /// A session's or delegation's name: 1 to 64 of A-Z a-z 0-9 - _ .
    public static func isName(_ text: String) -> Bool {
        (1...64).contains(text.utf8.count) && text.utf8.allSatisfy { byte in
            (0x30...0x39).contains(byte) || (0x41...0x5A).contains(byte) || (0x61...0x7A).contains(byte)
                || byte == UInt8(ascii: "-") || byte == UInt8(ascii: "_") || byte == UInt8(ascii: ".")
        }
    }
}
