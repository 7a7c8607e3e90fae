/// Base64 (RFC 4648, with padding).
public enum Base64 {
    private static let alphabet = Array("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/".utf8)

    public static func encode(_ bytes: [UInt8]) -> String {
        String(decoding: encoded(bytes, alphabet: alphabet, padded: true), as: UTF8.self)
    }

    private static let urlAlphabet = Array("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_".utf8)

    private static func encoded(_ bytes: [UInt8], alphabet: [UInt8], padded: Bool) -> [UInt8] {
        var output: [UInt8] = []
        output.reserveCapacity((bytes.count + 2) / 3 * 4)
        var index = 0
        while index < bytes.count {
            let chunk = bytes[index..<min(index + 3, bytes.count)]
            let b0 = chunk[chunk.startIndex]
            let b1 = chunk.count > 1 ? chunk[chunk.startIndex + 1] : 0
            let b2 = chunk.count > 2 ? chunk[chunk.startIndex + 2] : 0
            output.append(alphabet[Int(b0 >> 2)])
            output.append(alphabet[Int((b0 & 0x03) << 4 | b1 >> 4)])
            if chunk.count > 1 { output.append(alphabet[Int((b1 & 0x0F) << 2 | b2 >> 6)]) } else if padded { output.append(UInt8(ascii: "=")) }
            if chunk.count > 2 { output.append(alphabet[Int(b2 & 0x3F)]) } else if padded { output.append(UInt8(ascii: "=")) }
            index += 3
        }
        return output
    }

    /// base64url without padding (RFC 4648 §5; JOSE's encoding).
    public static func urlEncode(_ bytes: [UInt8]) -> String {
        String(decoding: encoded(bytes, alphabet: urlAlphabet, padded: false), as: UTF8.self)
    }

    /// base64url without padding, strictly: nil for any other character, padding, or a length
    /// no encoding has.
    public static func urlDecode<S: StringProtocol>(_ text: S) -> [UInt8]? {
        guard text.utf8.count % 4 != 1, text.utf8.allSatisfy({ (0x41...0x5A).contains($0) || (0x61...0x7A).contains($0) || (0x30...0x39).contains($0)
                                                               || $0 == UInt8(ascii: "-") || $0 == UInt8(ascii: "_") }) else { return nil }
        return decode(String(text.map { $0 == "-" ? "+" : $0 == "_" ? "/" : $0 }))
    }

    public static func decode(_ text: String) -> [UInt8]? {
        var values: [UInt8] = []
        for byte in text.utf8 where byte != UInt8(ascii: "=") {
            guard let index = alphabet.firstIndex(of: byte) else { return nil }
            values.append(UInt8(index))
        }
        var output: [UInt8] = []
        var index = 0
        while index + 1 < values.count {
            output.append(values[index] << 2 | values[index + 1] >> 4)
            if index + 2 < values.count { output.append(values[index + 1] << 4 | values[index + 2] >> 2) }
            if index + 3 < values.count { output.append(values[index + 2] << 6 | values[index + 3]) }
            index += 4
        }
        return output
    }
}
