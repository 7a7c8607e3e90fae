import Sealing
import TokenBrokerCore
import WireJSON

/// Why a value read from etcd is not taken. Each names what is wrong, never the value.
enum FleetValueProblem: Error, Sendable, Equatable, CustomStringConvertible {
    /// It does not open with the fleet key: written without it (forged), under another key, or
    /// altered.
    case unsealed(String)
    /// It opens, but is not a well-formed value of its field, or its numbers are out of range.
    case malformed(String)
    /// It opens, but was written at another place in the key's history: an old value written
    /// back (a replay), or the key deleted and written anew.
    case misplaced
    /// It opens, but its position leaves less than `FleetPosition.room` below the limit: no
    /// broker counts there, and following it would leave the fleet no generations to log in with.
    case nearLimit(FleetPosition)

    var description: String {
        switch self {
        case let .unsealed(why): return "does not open with the fleet key (\(why))"
        case let .malformed(why): return "is not a well-formed value (\(why))"
        case .misplaced: return "was written elsewhere in the key's history (an old value written back)"
        case let .nearLimit(position):
            return "is at \(position), within 2^48 of the limit where no broker counts (sealed with the fleet key by "
                + "someone who should not hold it?); log in again"
        }
    }
}

/// Seals what a fleet session writes to etcd and opens what it reads, trusting nothing:
/// - the state value is sealed (AES-256-GCM) under the fleet key with its etcd key's path as
///   associated data, so it opens only under the key it was written to;
/// - it says where in its key's life it was written — the key's create revision and the
///   version that write gave it (create revision 0: the write that created the key, which
///   carries no token) — and is refused anywhere else, so an old value written back, or a key
///   deleted and written anew, is recognised whoever did it;
/// - the flight claim and the backoff note are part of it, so they are as authentic, and as
///   placed, as the tokens;
/// - every number is bounded, expiries are clamped to ±10 years, texts are cut and printable; a
///   position within `FleetPosition.room` of the limit is refused.
struct FleetCodec: Sendable {
    static let version = "1"
    /// The largest value accepted, before it is opened.
    static let maximumValue = 64 << 10
    /// How far from now an expiry or time may lie, in seconds (as the state database's restore).
    static let timeBound: Double = 3e8

    let cipher: TokenCipher
    let keys: FleetKeys

    // MARK: - State

    /// `state` sealed to be written over `current` (nil: the key does not exist yet, and the
    /// write creates it: such a state must carry no token).
    func seal(_ state: FleetState, over current: EtcdKeyValue?) throws(FleetValueProblem) -> [UInt8] {
        let created = current?.createRevision ?? 0
        let version = (current?.version ?? 0) + 1
        guard created != 0 || !state.hasTokens else { throw .malformed("a state that creates its key carries no token") }
        var object: JSONObject = ["v": .string(Self.version), "c": .string(String(created)), "k": .string(String(version)),
                                  "g": .string(String(state.position.generation)), "n": .string(String(state.position.serial)),
                                  "s": .string(state.phase.rawValue), "tt": .string(state.tokenType)]
        // (History 0 is written as none: a value of the first history reads the same to a broker of before resets.)
        if state.position.history > 0 { object["h"] = .string(String(state.position.history)) }
        if let token = state.refreshToken { object["rt"] = .string(token.reveal) }
        if let token = state.accessToken { object["at"] = .string(token.reveal) }
        if let expiresAt = state.expiresAt { object["exp"] = .string(String(expiresAt)) }
        if let lastRefresh = state.lastRefresh { object["lr"] = .string(String(lastRefresh)) }
        if let endReason = state.endReason { object["er"] = .string(Self.printable(endReason)) }
        if let claim = state.flight {
            object["fh"] = .string(Self.printable(claim.holder))
            object["fl"] = .string(String(claim.lease.milliseconds))
            object["ft"] = .string(String(claim.taken))
        }
        if let note = state.backoff {
            object["bu"] = .string(String(note.until))
            object["br"] = .string(Self.printable(note.reason))
        }
        return try seal(object, at: keys.state)
    }

    /// The state `record` holds, checked for where it was written; `unixNow` bounds its times.
    func openState(_ record: EtcdKeyValue, unixNow: Double) -> Result<FleetState, FleetValueProblem> {
        let object: JSONObject
        switch open(record.value, at: keys.state) {
        case let .success(opened): object = opened
        case let .failure(problem): return .failure(problem)
        }
        guard let created = Self.number(object["c"], below: etcdNumberLimit), let version = Self.number(object["k"], below: etcdNumberLimit),
              let generation = Self.number(object["g"], below: FleetPosition.limit),
              let serial = Self.number(object["n"], below: FleetPosition.limit),
              let history = object["h"] == nil ? 0 : Self.number(object["h"], below: FleetPosition.limit),
              let position = FleetPosition(history: history, generation: generation, serial: serial),
              let phase = object["s"]?.stringValue.flatMap(SessionState.init(rawValue:)) else {
            return .failure(.malformed("a state without its place, position or phase"))
        }
        var state = FleetState(position: position, phase: phase, refreshToken: Self.secret(object["rt"]), accessToken: Self.secret(object["at"]),
                               tokenType: object["tt"]?.stringValue.map { String(Self.printable($0).prefix(40)) } ?? "Bearer",
                               expiresAt: Self.time(object["exp"], around: unixNow), lastRefresh: Self.time(object["lr"], around: unixNow),
                               endReason: object["er"]?.stringValue.map(Self.printable))
        if state.tokenType.isEmpty { state.tokenType = "Bearer" }
        if let holder = object["fh"]?.stringValue {
            guard let lease = Self.number(object["fl"], below: Int64.max / 4), let taken = Self.number(object["ft"], below: Int64.max / 4) else {
                return .failure(.malformed("a flight claim without its lease or time"))
            }
            state.flight = FlightClaim(holder: String(Self.printable(holder).prefix(200)),
                                       lease: .milliseconds(min(max(lease, 1_000), 3_600_000)), taken: taken)
        }
        if let until = object["bu"] {
            guard let until = Self.number(until, below: Int64.max / 4) else { return .failure(.malformed("a backoff without its time")) }
            // At most an hour from now, whatever it says.
            let latest = Int64(min(max(unixNow, 0), 1e12)) * 1000 + 3_600_000
            state.backoff = BackoffNote(until: min(until, latest), reason: Self.printable(object["br"]?.stringValue ?? "refresh failed"))
        }
        if phase != .active, state.flight != nil || state.backoff != nil { return .failure(.malformed("a state that is not active but refreshes")) }
        if phase != .active, state.hasTokens { return .failure(.malformed("a state that is not active but carries tokens")) }
        if created == 0 {
            guard version == 1, record.version == 1, !state.hasTokens else { return .failure(.misplaced) }
        } else {
            guard created == record.createRevision, version == record.version else { return .failure(.misplaced) }
        }
        guard position.leavesRoom else { return .failure(.nearLimit(position)) }
        return .success(state)
    }

    // MARK: - Sealing

    private func seal(_ object: JSONObject, at key: [UInt8]) throws(FleetValueProblem) -> [UInt8] {
        var bytes: [UInt8] = []
        object.encode(into: &bytes)
        do {
            let sealed = Array(try cipher.seal(String(decoding: bytes, as: UTF8.self), associatedData: Self.associatedData(key)).utf8)
            guard sealed.count <= Self.maximumValue else { throw FleetValueProblem.malformed("a value larger than 64K") }
            return sealed
        } catch let problem as FleetValueProblem {
            throw problem
        } catch {
            throw .malformed("cannot seal: \(error)")
        }
    }

    private func open(_ value: [UInt8], at key: [UInt8]) -> Result<JSONObject, FleetValueProblem> {
        guard value.count <= Self.maximumValue else { return .failure(.malformed("larger than 64K")) }
        let text: String
        do {
            text = try cipher.open(String(decoding: value, as: UTF8.self), associatedData: Self.associatedData(key))
        } catch {
            return .failure(.unsealed(value.starts(with: Array("tbenc1:".utf8)) ? "wrong key, or altered" : "not sealed"))
        }
        guard let object = (try? JSONParser.parse(Array(text.utf8), limits: JSONLimits(maximumDepth: 2, maximumMembers: 32)))?.objectValue,
              object["v"]?.stringValue == Self.version else {
            return .failure(.malformed("not a value of this format"))
        }
        return .success(object)
    }

    /// The associated data of a value: the format and the etcd key's path.
    static func associatedData(_ key: [UInt8]) -> String {
        "tokenbroker fleet " + version + " " + String(decoding: key, as: UTF8.self)
    }

    // MARK: - Bounds

    private static func number(_ value: JSON?, below limit: Int64) -> Int64? {
        guard let number = value?.stringValue.flatMap({ Int64($0) }), (0..<limit).contains(number) else { return nil }
        return number
    }

    private static func secret(_ value: JSON?) -> Secret? {
        guard let text = value?.stringValue, !text.isEmpty else { return nil }
        return Secret(text)
    }

    /// A Unix time within `timeBound` of `unixNow` (clamped; nil when absent or not a number).
    private static func time(_ value: JSON?, around unixNow: Double) -> Int64? {
        guard let number = value?.stringValue.flatMap({ Int64($0) }) else { return nil }
        return expiry(min(max(Double(number), unixNow - timeBound), unixNow + timeBound))
    }

    /// Seconds as a whole number of Unix seconds, whatever the double (no trapping conversion).
    static func expiry(_ seconds: Double) -> Int64 {
        guard seconds.isFinite else { return 0 }
        return Int64(min(max(seconds, -9e15), 9e15).rounded(.down))
    }

    /// Text that came from another broker, as one printable line of at most 200 characters.
    static func printable(_ text: String) -> String {
        var result = ""
        for scalar in text.unicodeScalars.prefix(200) {
            switch scalar.value {
            case 0x00..<0x20, 0x7F, 0x80...0x9F, 0x2028, 0x2029: result.unicodeScalars.append("?")
            default: result.unicodeScalars.append(scalar)
            }
        }
        return result
    }
}
