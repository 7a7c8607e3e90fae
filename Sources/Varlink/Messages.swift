import Synchronization
import WireJSON

/// A message that is not a valid varlink call: the connection has no valid reply and closes.
public struct VarlinkProtocolError: Error, Sendable, Equatable, CustomStringConvertible {
    public var reason: String
    public init(_ reason: String) { self.reason = reason }

    /// A client's text inside a reason: quoted, at most 40 characters, JSON-escaped (a reason is
    /// logged, and must not carry a forged line or a megabyte of someone's key).
    static func quoted(_ text: String) -> String {
        var output: [UInt8] = []
        let scalars = text.unicodeScalars
        JSON.string(scalars.count > 40 ? String(String.UnicodeScalarView(scalars.prefix(40))) + "…" : text).encode(into: &output)
        return String(decoding: output, as: UTF8.self)
    }
    public var description: String { "protocol error: \(reason)" }

    /// One message as a JSON object, or the protocol error saying why it is not one.
    static func object(_ bytes: ArraySlice<UInt8>, _ what: String, limits: JSONLimits) throws(VarlinkProtocolError) -> JSONObject {
        let json: JSON
        do {
            json = try JSONParser.parse(bytes, limits: limits)
        } catch {
            throw VarlinkProtocolError(error.description)
        }
        guard case let .object(object) = json else { throw VarlinkProtocolError("\(what) must be a JSON object") }
        return object
    }
}

/// A method call (client → service).
public struct VarlinkCall: Sendable, Equatable {
    /// Fully qualified: `interface.Method`.
    public var method: String {
        didSet { (interface, member) = Self.split(method) }
    }
    /// The interface part of `method` (everything before the last dot).
    public private(set) var interface: String
    /// The member part of `method` (after the last dot).
    public private(set) var member: String
    public var parameters: JSONObject
    /// No reply is wanted.
    public var oneway: Bool
    /// Several replies are welcome (a stream).
    public var more: Bool
    /// The connection becomes a raw byte stream after the reply.
    public var upgrade: Bool

    public init(method: String, parameters: JSONObject = [:], oneway: Bool = false, more: Bool = false, upgrade: Bool = false) {
        self.method = method
        (interface, member) = Self.split(method)
        self.parameters = parameters
        self.oneway = oneway
        self.more = more
        self.upgrade = upgrade
    }

    /// Split once, on the UTF-8 bytes (a dot is one byte): the hot path asks for both parts.
    private static func split(_ method: String) -> (interface: String, member: String) {
        let utf8 = method.utf8
        guard let dot = utf8.lastIndex(of: UInt8(ascii: ".")) else { return ("", method) }
        return (String(Substring(utf8[..<dot])), String(Substring(utf8[utf8.index(after: dot)...])))
    }

    /// Reads a call from one message. Unknown keys are refused unless they are vendor
    /// extensions (a dotted name); at most one of `oneway`, `more`, `upgrade` may be set.
    public static func decode(_ bytes: ArraySlice<UInt8>, limits: JSONLimits = .standard) throws(VarlinkProtocolError) -> VarlinkCall {
        let object = try VarlinkProtocolError.object(bytes, "a call", limits: limits)
        var call = VarlinkCall(method: "")
        var sawMethod = false
        for (key, value) in object {
            switch key {
            case "method":
                guard let method = value.stringValue, !method.isEmpty else { throw VarlinkProtocolError("'method' must be a string") }
                call.method = method
                sawMethod = true
            case "parameters":
                switch value {
                case .null: break
                case let .object(parameters): call.parameters = parameters
                default: throw VarlinkProtocolError("'parameters' must be an object")
                }
            case "oneway", "more", "upgrade":
                let flag: Bool
                switch value {
                case .null: flag = false
                case let .bool(value): flag = value
                default: throw VarlinkProtocolError("'\(key)' must be a boolean")
                }
                if key == "oneway" { call.oneway = flag } else if key == "more" { call.more = flag } else { call.upgrade = flag }
            default:
                guard key.contains(".") else { throw VarlinkProtocolError("unknown call field \(VarlinkProtocolError.quoted(key))") }
            }
        }
        guard sawMethod else { throw VarlinkProtocolError("no 'method'") }
        guard [call.oneway, call.more, call.upgrade].filter({ $0 }).count <= 1 else {
            throw VarlinkProtocolError("at most one of 'oneway', 'more' and 'upgrade' may be set")
        }
        return call
    }

    /// The call as one message, NUL included.
    public func encoded() -> [UInt8] {
        var object: JSONObject = ["method": .string(method)]
        if !parameters.isEmpty { object["parameters"] = .object(parameters) }
        if oneway { object["oneway"] = true }
        if more { object["more"] = true }
        if upgrade { object["upgrade"] = true }
        var output: [UInt8] = []
        object.encode(into: &output)
        output.append(0)
        return output
    }
}

/// A reply (service → client): parameters, or an error with its parameters.
///
/// A value, kept in one immutable box: a reply passes through several hands on the way out (the
/// handler's cache, the handling, the loop), and each copy is one retain. A change makes a new box.
public struct VarlinkReply: Sendable, Equatable {
    private final class Storage: Sendable {
        let storedParameters: JSONObject?
        /// `parameters` as JSON, when the same reply goes out many times (`preencoded()`), or
        /// when the reply was made of its bytes.
        let encodedParameters: [UInt8]?
        let continues: Bool
        let error: String?

        init(storedParameters: JSONObject?, encodedParameters: [UInt8]?, continues: Bool, error: String?) {
            (self.storedParameters, self.encodedParameters, self.continues, self.error) = (storedParameters, encodedParameters, continues, error)
        }

        func with(storedParameters: JSONObject?? = nil, encodedParameters: [UInt8]?? = nil, continues: Bool? = nil, error: String?? = nil) -> Storage {
            Storage(storedParameters: storedParameters ?? self.storedParameters, encodedParameters: encodedParameters ?? self.encodedParameters,
                    continues: continues ?? self.continues, error: error ?? self.error)
        }
    }

    private var storage: Storage

    /// The reply's parameters. A reply made from encoded parameters (`init(encodedParameters:)`)
    /// reads them back from its bytes.
    public var parameters: JSONObject {
        get {
            if let storedParameters = storage.storedParameters { return storedParameters }
            guard let encodedParameters = storage.encodedParameters,
                  case let .object(object)? = try? JSONParser.parse(encodedParameters[...], limits: Self.readBack) else {
                return [:]
            }
            return object
        }
        set {
            storage = storage.with(storedParameters: .some(newValue), encodedParameters: .some(nil))
        }
    }
    /// Encoded parameters are the service's own: read back without the limits a peer's get.
    private static let readBack = JSONLimits(maximumDepth: 64, maximumMembers: Int.max)
    /// More replies follow (only for calls with `more`).
    public var continues: Bool {
        get { storage.continues }
        set { if newValue != storage.continues { storage = storage.with(continues: newValue) } }
    }
    /// A fully qualified error name.
    public var error: String? {
        get { storage.error }
        set { storage = storage.with(error: .some(newValue)) }
    }

    public init(parameters: JSONObject = [:], continues: Bool = false, error: String? = nil) {
        storage = Storage(storedParameters: parameters, encodedParameters: nil, continues: continues, error: error)
    }

    /// A reply whose parameters are already encoded (one JSON object, compact): a large reply
    /// assembled from pieces encoded earlier (Status of thousands of sessions) is sent as it is.
    public init(encodedParameters: [UInt8], continues: Bool = false) {
        assert((try? JSONParser.parse(encodedParameters[...], limits: Self.readBack))?.objectValue != nil, "not one JSON object")
        storage = Storage(storedParameters: nil, encodedParameters: encodedParameters, continues: continues, error: nil)
    }

    public static func error(_ name: String, _ parameters: JSONObject = [:]) -> VarlinkReply {
        VarlinkReply(parameters: parameters, error: name)
    }

    /// The same reply with its parameters encoded once, for a reply that is sent again and again
    /// (a GetToken answer until the token changes): encoding it is then a copy.
    public func preencoded() -> VarlinkReply {
        var bytes: [UInt8] = []
        parameters.encode(into: &bytes)
        var copy = self
        copy.storage = storage.with(encodedParameters: .some(bytes))
        return copy
    }

    /// The reply with one more string member, `key` (not one of its parameters yet), at the end.
    /// A reply whose parameters are encoded gets its bytes and the member's, not a decoding and
    /// an encoding of the whole (GetProof: a token's reply, encoded once, and its proof).
    public func appending(_ key: String, string value: String) -> VarlinkReply {
        guard let encoded = storage.encodedParameters, encoded.last == UInt8(ascii: "}") else {
            var copy = self
            copy.parameters[key] = .string(value)
            return copy
        }
        assert(parameters[key] == nil, "\(key) is a member already")
        var bytes = encoded
        bytes.removeLast()
        if bytes.count > 1 { bytes.append(UInt8(ascii: ",")) }
        JSON.encodeString(key, into: &bytes)
        bytes.append(UInt8(ascii: ":"))
        JSON.encodeString(value, into: &bytes)
        bytes.append(UInt8(ascii: "}"))
        var copy = self
        copy.storage = Storage(storedParameters: nil, encodedParameters: bytes, continues: continues, error: error)
        return copy
    }

    public static func == (lhs: VarlinkReply, rhs: VarlinkReply) -> Bool {
        lhs.parameters == rhs.parameters && lhs.continues == rhs.continues && lhs.error == rhs.error
    }

    /// Appends the reply as one message, NUL included.
    public func encode(into output: inout [UInt8]) {
        output.append(UInt8(ascii: "{"))
        var first = true
        if let error {
            output.append(contentsOf: #""error":"#.utf8)
            JSON.encodeString(error, into: &output)
            first = false
        }
        if !first { output.append(UInt8(ascii: ",")) }
        output.append(contentsOf: #""parameters":"#.utf8)
        if let encodedParameters = storage.encodedParameters { output.append(contentsOf: encodedParameters) } else { parameters.encode(into: &output) }
        if continues { output.append(contentsOf: #","continues":true"#.utf8) }
        output.append(UInt8(ascii: "}"))
        output.append(0)
    }

    public func encoded() -> [UInt8] {
        var output: [UInt8] = []
        encode(into: &output)
        return output
    }

    /// Reads a reply from one message. Unknown keys are ignored; absent or null parameters
    /// are empty.
    public static func decode(_ bytes: ArraySlice<UInt8>, limits: JSONLimits = .standard) throws(VarlinkProtocolError) -> VarlinkReply {
        let object = try VarlinkProtocolError.object(bytes, "a reply", limits: limits)
        var (parameters, continues, error): (JSONObject, Bool, String?) = ([:], false, nil)
        switch object["parameters"] {
        case nil, .null?: break
        case let .object(value)?: parameters = value
        default: throw VarlinkProtocolError("'parameters' must be an object")
        }
        switch object["continues"] {
        case nil, .null?: break
        case let .bool(value)?: continues = value
        default: throw VarlinkProtocolError("'continues' must be a boolean")
        }
        switch object["error"] {
        case nil, .null?: break
        case let .string(name)?: error = name
        default: throw VarlinkProtocolError("'error' must be a string")
        }
        return VarlinkReply(parameters: parameters, continues: continues, error: error)
    }
}

/// The errors of `org.varlink.service`, which every service may return.
public enum VarlinkServiceError {
    public static let interfaceNotFound = "org.varlink.service.InterfaceNotFound"
    public static let methodNotFound = "org.varlink.service.MethodNotFound"
    public static let methodNotImplemented = "org.varlink.service.MethodNotImplemented"
    public static let invalidParameter = "org.varlink.service.InvalidParameter"
    public static let permissionDenied = "org.varlink.service.PermissionDenied"
    public static let expectedMore = "org.varlink.service.ExpectedMore"
}

/// Descriptions of calls and replies hide the values of the members an interface declares
/// secret (`VarlinkInterface.secretMembers`, registered here when the interface is made), at any
/// depth, so that a call or reply printed by mistake (a log line, a failed test's report) shows
/// no secret. Encoding is not affected. The varlink layer knows no member names of its own.
public enum VarlinkRedaction {
    /// (A list: a few names, registered by every client at its first call, where building and
    /// hashing a set cost a `ctl token` a tenth of its instructions.)
    private static let names = Mutex<[String]>([])

    /// Hides `members` in every description from now on.
    public static func register(_ members: [String]) {
        names.withLock { names in
            for member in members where !names.contains(member) { names.append(member) }
        }
    }

    /// Hides `members` in every description from now on.
    public static func register(_ members: Set<String>) { register(Array(members)) }

    /// Before any interface has said which members are secret, every string is (fail closed).
    static func isSensitive(_ key: String) -> Bool {
        names.withLock { $0.isEmpty || $0.contains(key) }
    }
}

enum Redaction {
    static func isSensitive(_ key: String) -> Bool { VarlinkRedaction.isSensitive(key) }

    static func redacted(_ object: JSONObject) -> String {
        JSON.object(redact(object)).text
    }

    private static func redact(_ object: JSONObject) -> JSONObject {
        JSONObject(object.members.map { member in
            if isSensitive(member.key), case .string = member.value { return (member.key, JSON.string("<redacted>")) }
            return (member.key, redact(member.value))
        })
    }

    private static func redact(_ value: JSON) -> JSON {
        switch value {
        case let .object(object): return .object(redact(object))
        case let .array(elements): return .array(elements.map(redact))
        default: return value
        }
    }
}

extension VarlinkCall: CustomStringConvertible {
    public var description: String {
        var flags = ""
        if oneway { flags += " oneway" }
        if more { flags += " more" }
        return "\(method)\(flags) \(Redaction.redacted(parameters))"
    }
}

extension VarlinkReply: CustomStringConvertible {
    public var description: String {
        (error.map { "error \($0) " } ?? "") + Redaction.redacted(parameters) + (continues ? " (continues)" : "")
    }
}
