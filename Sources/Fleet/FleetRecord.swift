import Basics
import Sealing
import TokenBrokerCore
import Upstream
import WireJSON

/// How brokers of a fleet reach etcd, and what they share there.
public struct FleetSettings: Sendable, Equatable {
    /// etcd members' client URLs (`Endpoints=`), tried in order.
    public var endpoints: [String]
    /// Where the fleet's keys live (`Prefix=`): `<prefix>/sessions/<name>/…`.
    public var prefix: String
    /// The CA, client certificate and key for etcd's TLS (`CAFile=`, `ClientCertificate=`, `ClientKey=`).
    public var tls: TLSOptions
    /// Seals every record (`KeyFile=` or `KeyCredential=`): 32 bytes or 64 hex digits.
    public var key: Secret
    /// The lease of a flight (`FlightLease=`): how long a broker that took the flight and then
    /// vanished keeps the others from refreshing. Longer than an upstream request may take.
    public var flightLease: Duration
    /// The deadline of one etcd request (`RequestTimeout=`).
    public var requestTimeout: Duration
    /// This broker's name in flight records and status (`Name=`; the host name by default).
    public var member: String

    public init(endpoints: [String], prefix: String = "/tokenbroker", tls: TLSOptions = TLSOptions(), key: Secret,
                flightLease: Duration = .seconds(60), requestTimeout: Duration = .seconds(2), member: String) {
        self.endpoints = endpoints
        self.prefix = prefix
        self.tls = tls
        self.key = key
        self.flightLease = flightLease
        self.requestTimeout = requestTimeout
        self.member = member
    }
}

/// A session's state as the fleet shares it: sealed (AES-256-GCM under the fleet key, with the
/// key's name as associated data) before it is put in etcd, which never holds a token in clear.
struct FleetRecord: Sendable, Equatable {
    /// The fleet generation: every login or logout anywhere in the fleet adds one.
    var generation: Int64
    var state: SessionState
    var refreshToken: Secret?
    var accessToken: Secret?
    var tokenType: String = "Bearer"
    var expiresAt: Int64?
    var lastRefresh: Int64?
    /// Counts the tokens of this generation, fleet-wide.
    var serial: UInt64 = 0
    var endReason: String?

    func sealed(with cipher: TokenCipher, associatedData: String) throws(TokenCipher.Failure) -> [UInt8] {
        var object: JSONObject = ["g": .string(String(generation)), "s": .string(state.rawValue), "tt": .string(tokenType),
                                  "n": .string(String(serial))]
        if let refreshToken { object["rt"] = .string(refreshToken.reveal) }
        if let accessToken { object["at"] = .string(accessToken.reveal) }
        if let expiresAt { object["exp"] = .string(String(expiresAt)) }
        if let lastRefresh { object["lr"] = .string(String(lastRefresh)) }
        if let endReason { object["er"] = .string(endReason) }
        var bytes: [UInt8] = []
        object.encode(into: &bytes)
        return Array(try cipher.seal(String(decoding: bytes, as: UTF8.self), associatedData: associatedData).utf8)
    }

    static func open(_ value: [UInt8], with cipher: TokenCipher, associatedData: String) throws(TokenCipher.Failure) -> FleetRecord {
        guard value.count <= 64 << 10 else { throw TokenCipher.Failure("a fleet record larger than 64K") }
        let text = try cipher.open(String(decoding: value, as: UTF8.self), associatedData: associatedData)
        guard let object = (try? JSONParser.parse(Array(text.utf8)))?.objectValue,
              let generation = object["g"]?.stringValue.flatMap({ Int64($0) }),
              let state = object["s"]?.stringValue.flatMap(SessionState.init(rawValue:)),
              let serial = object["n"]?.stringValue.flatMap({ UInt64($0) }) else {
            throw TokenCipher.Failure("a fleet record that is not one")
        }
        return FleetRecord(generation: generation, state: state, refreshToken: object["rt"]?.stringValue.map(Secret.init),
                           accessToken: object["at"]?.stringValue.map(Secret.init), tokenType: object["tt"]?.stringValue ?? "Bearer",
                           expiresAt: object["exp"]?.stringValue.flatMap { Int64($0) },
                           lastRefresh: object["lr"]?.stringValue.flatMap { Int64($0) }, serial: serial,
                           endReason: object["er"]?.stringValue.map { String($0.prefix(500)) })
    }
}
