extension JSON {
    /// Compact JSON (no whitespace), appended to `output`.
    public func encode(into output: inout [UInt8]) {
        switch self {
        case .null: output.append(contentsOf: "null".utf8)
        case let .bool(value): output.append(contentsOf: (value ? "true" : "false").utf8)
        case let .int(value): JSON.encodeInteger(value, into: &output)
        case let .double(value):
            // NaN and infinities have no JSON form; varlink forbids them.
            guard value.isFinite else { output.append(contentsOf: "null".utf8); return }
            if value.rounded() == value && abs(value) < 1e15 {
                output.append(contentsOf: String(Int64(value)).utf8)
                output.append(contentsOf: ".0".utf8)
            } else {
                output.append(contentsOf: value.description.utf8)
            }
        case let .string(value): JSON.encodeString(value, into: &output)
        case let .array(elements):
            output.append(UInt8(ascii: "["))
            for (index, element) in elements.enumerated() {
                if index > 0 { output.append(UInt8(ascii: ",")) }
                element.encode(into: &output)
            }
            output.append(UInt8(ascii: "]"))
        case let .object(object): object.encode(into: &output)
        }
    }

    /// Compact JSON bytes.
    public var encoded: [UInt8] {
        var output: [UInt8] = []
        encode(into: &output)
        return output
    }

    /// Compact JSON text.
    public var text: String { String(decoding: encoded, as: UTF8.self) }

    /// The decimal digits of `value` (no String made: replies carry many numbers).
    public static func encodeInteger(_ value: Int64, into output: inout [UInt8]) {
        if value < 0 { output.append(UInt8(ascii: "-")) }
        // (The magnitude as unsigned: Int64.min has no positive counterpart.)
        var magnitude = value.magnitude
        guard magnitude >= 10 else {
            output.append(UInt8(ascii: "0") + UInt8(magnitude))
            return
        }
        var digits: (UInt64, UInt64, UInt64) = (0, 0, 0)   // 19 digits at most, in 24 bytes
        var count = 0
        withUnsafeMutableBytes(of: &digits) { buffer in
            while magnitude > 0 {
                buffer[count] = UInt8(ascii: "0") + UInt8(magnitude % 10)
                magnitude /= 10
                count += 1
            }
            for index in stride(from: count - 1, through: 0, by: -1) { output.append(buffer[index]) }
        }
    }

    /// A JSON string literal for `value`: quotes, backslashes and control characters escaped,
    /// everything else as UTF-8. Runs without escapes (a token: all of it) are copied whole.
    public static func encodeString(_ value: String, into output: inout [UInt8]) {
        output.append(UInt8(ascii: "\""))
        var value = value
        value.withUTF8 { bytes in
            var run = 0
            for index in bytes.indices {
                let byte = bytes[index]
                guard byte < 0x20 || byte == UInt8(ascii: "\"") || byte == UInt8(ascii: "\\") else { continue }
                output.append(contentsOf: UnsafeBufferPointer(rebasing: bytes[run..<index]))
                appendEscape(byte, into: &output)
                run = index + 1
            }
            output.append(contentsOf: UnsafeBufferPointer(rebasing: bytes[run...]))
        }
        output.append(UInt8(ascii: "\""))
    }

    private static func appendEscape(_ byte: UInt8, into output: inout [UInt8]) {
        output.append(UInt8(ascii: "\\"))
        switch byte {
        case UInt8(ascii: "\""), UInt8(ascii: "\\"): output.append(byte)
        case 0x0A: output.append(UInt8(ascii: "n"))
        case 0x0D: output.append(UInt8(ascii: "r"))
        case 0x09: output.append(UInt8(ascii: "t"))
        default:
            func hex(_ nibble: UInt8) -> UInt8 { nibble < 10 ? UInt8(ascii: "0") + nibble : UInt8(ascii: "a") + nibble - 10 }
            output.append(UInt8(ascii: "u"))
            output.append(UInt8(ascii: "0"))
            output.append(UInt8(ascii: "0"))
            output.append(hex(byte >> 4))
            output.append(hex(byte & 0xF))
        }
    }
}

extension JSONObject {
    public func encode(into output: inout [UInt8]) {
        output.append(UInt8(ascii: "{"))
        for (index, member) in members.enumerated() {
            if index > 0 { output.append(UInt8(ascii: ",")) }
            JSON.encodeString(member.key, into: &output)
            output.append(UInt8(ascii: ":"))
            member.value.encode(into: &output)
        }
        output.append(UInt8(ascii: "}"))
    }
}
