/// A JSON value, as varlink carries it.
///
/// Objects keep their members in order (so output is deterministic and golden tests are
/// exact); parsing rejects duplicate keys, so a lookup is never ambiguous.
public enum JSON: Sendable, Equatable {
    case null
    case bool(Bool)
    /// An integer written without fraction or exponent that fits in 64 bits.
    case int(Int64)
    /// Any other number.
    case double(Double)
    case string(String)
    case array([JSON])
    case object(JSONObject)
}

/// The members of a JSON object, in order.
public struct JSONObject: Sendable, Equatable, ExpressibleByDictionaryLiteral, Sequence {
    public private(set) var members: [(key: String, value: JSON)]

    public init() { members = [] }

    public init(dictionaryLiteral elements: (String, JSON)...) {
        members = elements.map { (key: $0.0, value: $0.1) }
    }

    public init(_ members: [(key: String, value: JSON)]) { self.members = members }

    public var isEmpty: Bool { members.isEmpty }
    public var count: Int { members.count }
    public var keys: [String] { members.map(\.key) }

    /// The member named `key`; setting `nil` removes it, setting a value replaces it in place
    /// or appends it.
    public subscript(key: String) -> JSON? {
        get {
            // (By index: iterating copied each member, its value's payload included.)
            for index in members.indices where members[index].key == key { return members[index].value }
            return nil
        }
        set {
            if let index = members.firstIndex(where: { $0.key == key }) {
                if let newValue { members[index].value = newValue } else { members.remove(at: index) }
            } else if let newValue {
                members.append((key, newValue))
            }
        }
    }

    public func makeIterator() -> IndexingIterator<[(key: String, value: JSON)]> { members.makeIterator() }

    public static func == (lhs: JSONObject, rhs: JSONObject) -> Bool {
        lhs.members.count == rhs.members.count && lhs.members.allSatisfy { rhs[$0.key] == $0.value }
    }
}

extension JSON: ExpressibleByStringLiteral, ExpressibleByIntegerLiteral, ExpressibleByBooleanLiteral,
    ExpressibleByArrayLiteral, ExpressibleByDictionaryLiteral, ExpressibleByNilLiteral, ExpressibleByFloatLiteral {
    public init(stringLiteral value: String) { self = .string(value) }
    public init(integerLiteral value: Int64) { self = .int(value) }
    public init(booleanLiteral value: Bool) { self = .bool(value) }
    public init(arrayLiteral elements: JSON...) { self = .array(elements) }
    public init(dictionaryLiteral elements: (String, JSON)...) { self = .object(JSONObject(elements.map { (key: $0.0, value: $0.1) })) }
    public init(nilLiteral: ()) { self = .null }
    public init(floatLiteral value: Double) { self = .double(value) }
}

extension JSON {
    public var stringValue: String? {
        if case let .string(value) = self { return value }
        return nil
    }

    public var boolValue: Bool? {
        if case let .bool(value) = self { return value }
        return nil
    }

    /// The value as an integer: `.int`, or a `.double` with no fractional part in range.
    public var intValue: Int64? {
        switch self {
        case let .int(value): return value
        case let .double(value) where value.rounded() == value && abs(value) < 9.2e18: return Int64(value)
        default: return nil
        }
    }

    public var doubleValue: Double? {
        switch self {
        case let .int(value): return Double(value)
        case let .double(value): return value
        default: return nil
        }
    }

    public var objectValue: JSONObject? {
        if case let .object(value) = self { return value }
        return nil
    }

    public var arrayValue: [JSON]? {
        if case let .array(value) = self { return value }
        return nil
    }

    public var isNull: Bool { self == .null }
}
