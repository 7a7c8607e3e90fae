/// Why bytes are not a JSON value.
public struct JSONParseError: Error, Sendable, Equatable, CustomStringConvertible {
    /// Byte offset of the problem.
    public var offset: Int
    public var reason: String
    public var description: String { "invalid JSON at byte \(offset): \(reason)" }
}

/// How much structure a parse accepts, beyond what the size of the input already bounds.
public struct JSONLimits: Sendable, Equatable {
    /// Deepest nesting of arrays and objects.
    public var maximumDepth: Int
    /// Most members in one object.
    public var maximumMembers: Int

    public init(maximumDepth: Int = 64, maximumMembers: Int = 1024) {
        self.maximumDepth = maximumDepth
        self.maximumMembers = maximumMembers
    }

    public static let standard = JSONLimits()
}

/// A strict RFC 8259 parser over bytes: no trailing commas, no comments, no NaN, valid UTF-8,
/// no duplicate object keys, bounded nesting and members.
///
/// Linear in its input: duplicate keys are found through a hash set (Swift's string hashing is
/// seeded per process, so chosen keys cannot make it collide), never by comparing every pair.
public struct JSONParser {
    /// Deepest nesting of arrays and objects accepted by default.
    public static let maximumDepth = JSONLimits.standard.maximumDepth

    public static func parse(_ bytes: UnsafeRawBufferPointer, limits: JSONLimits = .standard) throws(JSONParseError) -> JSON {
        var parser = JSONParser(bytes: bytes, limits: limits)
        parser.skipWhitespace()
        let value = try parser.value(depth: 0)
        parser.skipWhitespace()
        guard parser.position == bytes.count else { throw parser.fail("trailing characters") }
        return value
    }

    /// A message as the varlink layer holds it (not generic: no metadata to look up per call).
    public static func parse(_ bytes: ArraySlice<UInt8>, limits: JSONLimits = .standard) throws(JSONParseError) -> JSON {
        try bytes.withUnsafeBytes { buffer in Result { () throws(JSONParseError) -> JSON in try parse(buffer, limits: limits) } }.get()
    }

    public static func parse<Bytes: Collection<UInt8>>(_ bytes: Bytes, limits: JSONLimits = .standard) throws(JSONParseError) -> JSON {
        let parseBuffer = { (buffer: UnsafeRawBufferPointer) in
            Result { () throws(JSONParseError) -> JSON in try parse(buffer, limits: limits) }
        }
        if let result = bytes.withContiguousStorageIfAvailable({ parseBuffer(UnsafeRawBufferPointer($0)) }) {
            return try result.get()
        }
        return try Array(bytes).withUnsafeBytes(parseBuffer).get()
    }

    public static func parse(_ text: String, limits: JSONLimits = .standard) throws(JSONParseError) -> JSON {
        try parse(Array(text.utf8), limits: limits)
    }

    private let bytes: UnsafeRawBufferPointer
    private let limits: JSONLimits
    private var position = 0

    private init(bytes: UnsafeRawBufferPointer, limits: JSONLimits) {
        self.bytes = bytes
        self.limits = limits
    }

    /// Below this many members a linear look for a duplicate is cheaper than hashing.
    private static let hashedFrom = 8

    private func fail(_ reason: String) -> JSONParseError {
        JSONParseError(offset: position, reason: reason)
    }

    private var peek: UInt8? { position < bytes.count ? bytes[position] : nil }

    private mutating func skipWhitespace() {
        while position < bytes.count {
            switch bytes[position] {
            case 0x20, 0x09, 0x0A, 0x0D: position += 1
            default: return
            }
        }
    }

    private mutating func value(depth: Int) throws(JSONParseError) -> JSON {
        guard let byte = peek else { throw fail("unexpected end") }
        switch byte {
        case UInt8(ascii: "{"): return try object(depth: depth + 1)
        case UInt8(ascii: "["): return try array(depth: depth + 1)
        case UInt8(ascii: "\""): return .string(try string())
        case UInt8(ascii: "t"): try literal("true"); return .bool(true)
        case UInt8(ascii: "f"): try literal("false"); return .bool(false)
        case UInt8(ascii: "n"): try literal("null"); return .null
        case UInt8(ascii: "-"), UInt8(ascii: "0")...UInt8(ascii: "9"): return try number()
        default: throw fail("unexpected character")
        }
    }

    private mutating func literal(_ word: StaticString) throws(JSONParseError) {
        let count = word.utf8CodeUnitCount
        guard bytes.count - position >= count else { throw fail("unexpected end") }
        let expected = UnsafeRawBufferPointer(start: word.utf8Start, count: count)
        for index in 0..<count where bytes[position + index] != expected[index] { throw fail("invalid literal") }
        position += count
    }

    private mutating func object(depth: Int) throws(JSONParseError) -> JSON {
        guard depth <= limits.maximumDepth else { throw fail("nested too deeply") }
        position += 1
        var members: [(key: String, value: JSON)] = []
        var seen: Set<String> = []
        skipWhitespace()
        if peek == UInt8(ascii: "}") {
            position += 1
            return .object(JSONObject(members))
        }
        while true {
            skipWhitespace()
            guard peek == UInt8(ascii: "\"") else { throw fail("expected a member name") }
            let start = position
            let key = try string()
            guard members.count < limits.maximumMembers else {
                throw JSONParseError(offset: start, reason: "more than \(limits.maximumMembers) members")
            }
            let duplicate: Bool
            if members.count < Self.hashedFrom {
                duplicate = members.contains { $0.key == key }
            } else {
                if seen.isEmpty { seen = Set(members.lazy.map(\.key)) }
                duplicate = !seen.insert(key).inserted
            }
            if duplicate { throw JSONParseError(offset: start, reason: "duplicate member name") }
            skipWhitespace()
            guard peek == UInt8(ascii: ":") else { throw fail("expected ':'") }
            position += 1
            skipWhitespace()
            members.append((key, try value(depth: depth)))
            skipWhitespace()
            switch peek {
            case UInt8(ascii: ","): position += 1
            case UInt8(ascii: "}"): position += 1; return .object(JSONObject(members))
            default: throw fail("expected ',' or '}'")
            }
        }
    }

    private mutating func array(depth: Int) throws(JSONParseError) -> JSON {
        guard depth <= limits.maximumDepth else { throw fail("nested too deeply") }
        position += 1
        var elements: [JSON] = []
        skipWhitespace()
        if peek == UInt8(ascii: "]") {
            position += 1
            return .array(elements)
        }
        while true {
            skipWhitespace()
            elements.append(try value(depth: depth))
            skipWhitespace()
            switch peek {
            case UInt8(ascii: ","): position += 1
            case UInt8(ascii: "]"): position += 1; return .array(elements)
            default: throw fail("expected ',' or ']'")
            }
        }
    }

    /// The text of `bytes` if they are valid UTF-8, else nil. Decoding repairs what is invalid
    /// (with U+FFFD), so the bytes come back unchanged exactly when they were valid; this is the
    /// standard library's fast, non-generic path (`String(validating:as:)` is generic and looks
    /// up type metadata on every call).
    private static func validUTF8(_ bytes: UnsafeRawBufferPointer) -> String? {
        let text = String(decoding: bytes, as: UTF8.self)
        if bytes.allSatisfy({ $0 < 0x80 }) { return text }
        return text.utf8.elementsEqual(bytes) ? text : nil
    }

    private mutating func string() throws(JSONParseError) -> String {
        position += 1
        let start = position
        // Fast path: no escapes.
        while position < bytes.count {
            let byte = bytes[position]
            if byte == UInt8(ascii: "\"") {
                guard let text = Self.validUTF8(UnsafeRawBufferPointer(rebasing: bytes[start..<position])) else {
                    throw JSONParseError(offset: start, reason: "invalid UTF-8")
                }
                position += 1
                return text
            }
            if byte == UInt8(ascii: "\\") { break }
            if byte < 0x20 { throw fail("control character in string") }
            position += 1
        }
        var scalars: [UInt8] = Array(UnsafeRawBufferPointer(rebasing: bytes[start..<position]))
        while true {
            guard let byte = peek else { throw fail("unterminated string") }
            position += 1
            switch byte {
            case UInt8(ascii: "\""):
                guard let text = scalars.withUnsafeBytes(Self.validUTF8) else {
                    throw JSONParseError(offset: start, reason: "invalid UTF-8")
                }
                return text
            case UInt8(ascii: "\\"):
                guard let escape = peek else { throw fail("unterminated escape") }
                position += 1
                switch escape {
                case UInt8(ascii: "\""), UInt8(ascii: "\\"), UInt8(ascii: "/"): scalars.append(escape)
                case UInt8(ascii: "b"): scalars.append(0x08)
                case UInt8(ascii: "f"): scalars.append(0x0C)
                case UInt8(ascii: "n"): scalars.append(0x0A)
                case UInt8(ascii: "r"): scalars.append(0x0D)
                case UInt8(ascii: "t"): scalars.append(0x09)
                case UInt8(ascii: "u"):
                    var code = UInt32(try hex4())
                    if (0xD800..<0xDC00).contains(code) {
                        guard peek == UInt8(ascii: "\\"), position + 1 < bytes.count, bytes[position + 1] == UInt8(ascii: "u") else {
                            throw fail("unpaired surrogate")
                        }
                        position += 2
                        let low = UInt32(try hex4())
                        guard (0xDC00..<0xE000).contains(low) else { throw fail("unpaired surrogate") }
                        code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)
                    } else if (0xDC00..<0xE000).contains(code) {
                        throw fail("unpaired surrogate")
                    }
                    guard let scalar = Unicode.Scalar(code) else { throw fail("invalid escape") }
                    scalars.append(contentsOf: UTF8.encode(scalar)!)
                default:
                    throw fail("invalid escape")
                }
            default:
                if byte < 0x20 { throw fail("control character in string") }
                scalars.append(byte)
            }
        }
    }

    private mutating func hex4() throws(JSONParseError) -> UInt16 {
        guard bytes.count - position >= 4 else { throw fail("short \\u escape") }
        var value: UInt16 = 0
        for _ in 0..<4 {
            let byte = bytes[position]
            let digit: UInt8
            switch byte {
            case UInt8(ascii: "0")...UInt8(ascii: "9"): digit = byte - UInt8(ascii: "0")
            case UInt8(ascii: "a")...UInt8(ascii: "f"): digit = byte - UInt8(ascii: "a") + 10
            case UInt8(ascii: "A")...UInt8(ascii: "F"): digit = byte - UInt8(ascii: "A") + 10
            default: throw fail("invalid \\u escape")
            }
            value = value << 4 | UInt16(digit)
            position += 1
        }
        return value
    }

    private mutating func number() throws(JSONParseError) -> JSON {
        let start = position
        if peek == UInt8(ascii: "-") { position += 1 }
        guard let first = peek, (UInt8(ascii: "0")...UInt8(ascii: "9")).contains(first) else { throw fail("invalid number") }
        if first == UInt8(ascii: "0") {
            position += 1
        } else {
            skipDigits()
        }
        var integral = true
        if peek == UInt8(ascii: ".") {
            integral = false
            position += 1
            guard try digitsFollow() else { throw fail("invalid number") }
        }
        if peek == UInt8(ascii: "e") || peek == UInt8(ascii: "E") {
            integral = false
            position += 1
            if peek == UInt8(ascii: "+") || peek == UInt8(ascii: "-") { position += 1 }
            guard try digitsFollow() else { throw fail("invalid number") }
        }
        let text = String(decoding: UnsafeRawBufferPointer(rebasing: bytes[start..<position]), as: UTF8.self)
        if integral, let value = Int64(text) { return .int(value) }
        guard let value = Double(text), value.isFinite else { throw JSONParseError(offset: start, reason: "number out of range") }
        return .double(value)
    }

    private mutating func skipDigits() {
        while let byte = peek, (UInt8(ascii: "0")...UInt8(ascii: "9")).contains(byte) { position += 1 }
    }

    private mutating func digitsFollow() throws(JSONParseError) -> Bool {
        let start = position
        skipDigits()
        return position > start
    }
}
