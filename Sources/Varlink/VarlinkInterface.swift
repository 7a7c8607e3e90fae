/// One interface a service offers: its name, its description text (returned byte for byte by
/// `GetInterfaceDescription`) and the method names declared in it.
public struct VarlinkInterface: Sendable {
    public let name: String
    public let description: String
    public let methods: Set<String>
    /// Members whose values are credentials: descriptions of calls and replies hide them
    /// (`VarlinkRedaction`).
    public let secretMembers: Set<String>

    /// Reads the name and the method names from the IDL text. Comments are skipped; the
    /// text is kept as it is. `secretMembers` are registered for redaction.
    public init(description: String, secretMembers: Set<String> = []) {
        self.description = description
        self.secretMembers = secretMembers
        VarlinkRedaction.register(secretMembers)
        // A line's first two words only, on the UTF-8 bytes through a pointer: the daemon reads
        // its 20 KB interface at every start (split into Characters it was a tenth of the start;
        // `split` on the UTF-8 view, 45 instructions a byte, still a twelfth).
        var name = ""
        var methods: Set<String> = []
        var text = description
        text.withUTF8 { bytes in
            let (newline, space, tab, parenthesis) = (UInt8(ascii: "\n"), UInt8(ascii: " "), UInt8(ascii: "\t"), UInt8(ascii: "("))
            let count = bytes.count
            /// The word at `start` (up to a blank or a parenthesis, within the line that ends at
            /// `end`), and where it ends.
            func word(from start: Int, to end: Int) -> (String, Int) {
                var stop = start
                while stop < end, bytes[stop] != space, bytes[stop] != tab, bytes[stop] != parenthesis { stop += 1 }
                return (String(decoding: UnsafeBufferPointer(rebasing: bytes[start..<stop]), as: UTF8.self), stop)
            }
            var index = 0
            while index < count {
                var start = index
                while start < count, bytes[start] == space || bytes[start] == tab { start += 1 }
                var end = start
                while end < count, bytes[end] != newline { end += 1 }
                index = end + 1
                guard start < end, bytes[start] == UInt8(ascii: "i") || bytes[start] == UInt8(ascii: "m") else { continue }
                let (first, stop) = word(from: start, to: end)
                guard first == "interface" || first == "method" else { continue }
                var next = stop
                while next < end, bytes[next] == space || bytes[next] == tab || bytes[next] == parenthesis { next += 1 }
                guard next < end else { continue }
                let (second, _) = word(from: next, to: end)
                if first == "interface", name.isEmpty { name = second }
                if first == "method" { methods.insert(second) }
            }
        }
        self.name = name
        self.methods = methods
    }
}

/// What `org.varlink.service.GetInfo` reports.
public struct VarlinkServiceInfo: Sendable {
    public var vendor: String
    public var product: String
    public var version: String
    public var url: String

    public init(vendor: String, product: String, version: String, url: String) {
        self.vendor = vendor
        self.product = product
        self.version = version
        self.url = url
    }
}

/// What a handler does with a call.
public enum VarlinkHandling: Sendable {
    /// Answer now, on the server's I/O thread.
    case reply(VarlinkReply)
    /// Answer later: the body runs in a task, sends its reply (or, for `more` calls, several
    /// replies) through the sink, and returns. The task is cancelled when the client
    /// disconnects; later calls on the same connection wait until it returns.
    case async(@Sendable (VarlinkReplySink) async -> Void)
}

/// Handles the calls of a service's own interfaces; `org.varlink.service`, unknown interfaces
/// and unknown methods are the server's. Called on the server's I/O thread: it must not block.
public protocol VarlinkHandler: Sendable {
    func handle(_ call: VarlinkCall, from peer: PeerCredentials) -> VarlinkHandling
}

extension VarlinkReply {
    /// `org.varlink.service.InvalidParameter` naming `parameter`.
    public static func invalidParameter(_ parameter: String) -> VarlinkReply {
        .error(VarlinkServiceError.invalidParameter, ["parameter": .string(parameter)])
    }
}

/// Typed access to call parameters, answering `InvalidParameter` for anything off.
public struct Parameters {
    public let object: JSONObject

    public init(_ object: JSONObject) { self.object = object }

    /// Refuses any parameter not in `allowed` (the method's declared fields; a handful, so a
    /// list: no set to build and hash on every call).
    public func only(_ allowed: [String]) throws(ParameterError) {
        // (By index, keys only: a member copied whole is a value copied too.)
        let members = object.members
        for index in members.indices where !allowed.contains(members[index].key) { throw ParameterError(name: members[index].key) }
    }

    /// Refuses any parameter but `name` and `others`.
    public func only(_ name: String, _ others: [String]) throws(ParameterError) {
        let members = object.members
        for index in members.indices where members[index].key != name && !others.contains(members[index].key) {
            throw ParameterError(name: members[index].key)
        }
    }

    public func string(_ name: String) throws(ParameterError) -> String {
        guard let value = object[name]?.stringValue else { throw ParameterError(name: name) }
        return value
    }

    public func optionalString(_ name: String) throws(ParameterError) -> String? {
        switch object[name] {
        case nil, .null?: return nil
        case let .string(value)?: return value
        default: throw ParameterError(name: name)
        }
    }

    public func bool(_ name: String) throws(ParameterError) -> Bool {
        guard let value = object[name]?.boolValue else { throw ParameterError(name: name) }
        return value
    }

    public func optionalBool(_ name: String) throws(ParameterError) -> Bool? {
        switch object[name] {
        case nil, .null?: return nil
        case let .bool(value)?: return value
        default: throw ParameterError(name: name)
        }
    }

    public func int(_ name: String) throws(ParameterError) -> Int64 {
        guard let value = object[name]?.intValue else { throw ParameterError(name: name) }
        return value
    }

    public func double(_ name: String) throws(ParameterError) -> Double {
        guard let value = object[name]?.doubleValue else { throw ParameterError(name: name) }
        return value
    }

    public func value(_ name: String) throws(ParameterError) -> JSON {
        guard let value = object[name] else { throw ParameterError(name: name) }
        return value
    }
}

/// A parameter is missing, of the wrong type, or not declared.
public struct ParameterError: Error, Sendable, Equatable {
    public var name: String
    public init(name: String) { self.name = name }
    public var reply: VarlinkReply { .invalidParameter(name) }
}
