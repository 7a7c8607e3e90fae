import Varlink

/// One audit record as `Audit` lists it: a token (by its serial, never its value) handed to a
/// peer, by which methods and how often.
public struct AuditEntry: Sendable, Equatable {
    public var session: String
    /// The key (`resource`, `scope`) the token is narrowed to, when it is a key's.
    public var resource: String?
    public var scope: String?
    public var generation: Int64
    public var tokenSerial: Int64
    public var pid: Int64
    public var uid: Int64
    public var gid: Int64
    /// The peer's systemd unit, when it has one and it could be read.
    public var unit: String?
    /// The delegation the peer came through.
    public var delegation: String?
    public var methods: [String]
    public var count: Int64
    /// When it was first and last handed out, Unix seconds.
    public var first: Int64
    public var last: Int64

    /// The most records one call lists (the daemon keeps no more).
    public static let mostListed = 512

    public init(session: String, resource: String? = nil, scope: String? = nil, generation: Int64, tokenSerial: Int64, pid: Int64, uid: Int64,
                gid: Int64, unit: String? = nil, delegation: String? = nil, methods: [String], count: Int64, first: Int64, last: Int64) {
        (self.session, self.resource, self.scope, self.generation, self.tokenSerial) = (session, resource, scope, generation, tokenSerial)
        (self.pid, self.uid, self.gid, self.unit, self.delegation) = (pid, uid, gid, unit, delegation)
        (self.methods, self.count, self.first, self.last) = (methods, count, first, last)
    }

    public init?(_ object: JSONObject) {
        guard let session = object["session"]?.stringValue, let generation = object["generation"]?.intValue,
              let serial = object["tokenSerial"]?.intValue, let pid = object["pid"]?.intValue, let uid = object["uid"]?.intValue,
              let gid = object["gid"]?.intValue, let count = object["count"]?.intValue, let first = object["first"]?.intValue,
              let last = object["last"]?.intValue else { return nil }
        self.init(session: session, resource: object["resource"]?.stringValue, scope: object["scope"]?.stringValue, generation: generation,
                  tokenSerial: serial, pid: pid, uid: uid, gid: gid, unit: object["unit"]?.stringValue, delegation: object["delegation"]?.stringValue,
                  methods: (object["methods"]?.arrayValue ?? []).prefix(16).compactMap(\.stringValue), count: count, first: first, last: last)
    }

    public var parameters: JSONObject {
        var object: JSONObject = ["session": .string(session), "generation": .int(generation), "tokenSerial": .int(tokenSerial),
                                  "pid": .int(pid), "uid": .int(uid), "gid": .int(gid), "methods": .array(methods.map(JSON.string)),
                                  "count": .int(count), "first": .int(first), "last": .int(last)]
        if let resource { object["resource"] = .string(resource) }
        if let scope { object["scope"] = .string(scope) }
        if let unit { object["unit"] = .string(unit) }
        if let delegation { object["delegation"] = .string(delegation) }
        return object
    }
}
