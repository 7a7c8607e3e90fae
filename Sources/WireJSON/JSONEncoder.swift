extension JSON {
    /// Compact JSON (no whitespace), appended to `output`.
    public func encode(into output: inout [UInt8]) {
        switch self {
        case .null: output.append(contentsOf: "null".utf8)
        case let .bool(value): output.append(contentsOf: (value ? "true" : "false").utf8)
        case let .int(value): output.append(contentsOf: String(value).utf8)
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

    /// A JSON string literal for `value`: quotes, backslashes and control characters escaped,
    /// everything else as UTF-8.
    public static func encodeString(_ value: String, into output: inout [UInt8]) {
        output.append(UInt8(ascii: "\""))
        for byte in value.utf8 {
            switch byte {
            case UInt8(ascii: "\""): output.append(contentsOf: [UInt8(ascii: "\\"), UInt8(ascii: "\"")])
            case UInt8(ascii: "\\"): output.append(contentsOf: [UInt8(ascii: "\\"), UInt8(ascii: "\\")])
            case 0x0A: output.append(contentsOf: [UInt8(ascii: "\\"), UInt8(ascii: "n")])
            case 0x0D: output.append(contentsOf: [UInt8(ascii: "\\"), UInt8(ascii: "r")])
            case 0x09: output.append(contentsOf: [UInt8(ascii: "\\"), UInt8(ascii: "t")])
            case 0x00..<0x20:
                let hex: [UInt8] = Array("0123456789abcdef".utf8)
                output.append(contentsOf: [UInt8(ascii: "\\"), UInt8(ascii: "u"), UInt8(ascii: "0"), UInt8(ascii: "0"),
                                           hex[Int(byte >> 4)], hex[Int(byte & 0xF)]])
            default: output.append(byte)
            }
        }
        output.append(UInt8(ascii: "\""))
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
