/// Base64 (RFC 4648, with padding).
public enum Base64 {
    private static let alphabet = Array("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/".utf8)

    public static func encode(_ bytes: [UInt8]) -> String {
        String(decoding: encoded(bytes, alphabet: alphabet, padded: true), as: UTF8.self)
    }

    private static let urlAlphabet = Array("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_".utf8)

    private static func encoded(_ bytes: [UInt8], alphabet: [UInt8], padded: Bool) -> [UInt8] {
        let whole = bytes.count / 3
        let rest = bytes.count - whole * 3
        let count = whole * 4 + (rest == 0 ? 0 : padded ? 4 : rest + 1)
        // Written in place, three bytes to four characters at a time (a proof encodes a few
        // hundred bytes on the varlink loop: appending byte by byte was most of its encoding).
        return [UInt8](unsafeUninitializedCapacity: count) { output, initialized in
            bytes.withUnsafeBufferPointer { input in
                alphabet.withUnsafeBufferPointer { alphabet in
                    var out = 0
                    for group in 0..<whole {
                        let (b0, b1, b2) = (input[group * 3], input[group * 3 + 1], input[group * 3 + 2])
                        output[out] = alphabet[Int(b0 >> 2)]
                        output[out + 1] = alphabet[Int((b0 & 0x03) << 4 | b1 >> 4)]
                        output[out + 2] = alphabet[Int((b1 & 0x0F) << 2 | b2 >> 6)]
                        output[out + 3] = alphabet[Int(b2 & 0x3F)]
                        out += 4
                    }
                    if rest > 0 {
                        let b0 = input[whole * 3]
                        let b1 = rest > 1 ? input[whole * 3 + 1] : 0
                        output[out] = alphabet[Int(b0 >> 2)]
                        output[out + 1] = alphabet[Int((b0 & 0x03) << 4 | b1 >> 4)]
                        out += 2
                        if rest > 1 {
                            output[out] = alphabet[Int((b1 & 0x0F) << 2)]
                            out += 1
                        } else if padded {
                            output[out] = UInt8(ascii: "=")
                            out += 1
                        }
                        if padded {
                            output[out] = UInt8(ascii: "=")
                            out += 1
                        }
                    }
                    initialized = out
                }
            }
        }
    }

    /// base64url without padding (RFC 4648 §5; JOSE's encoding).
    public static func urlEncode(_ bytes: [UInt8]) -> String {
        String(decoding: encoded(bytes, alphabet: urlAlphabet, padded: false), as: UTF8.self)
    }

    /// base64url without padding, strictly: nil for any other character, padding, or a length
    /// no encoding has.
    public static func urlDecode<S: StringProtocol>(_ text: S) -> [UInt8]? {
        guard text.utf8.count % 4 != 1 else { return nil }
        return decoded(text.utf8, url: true)
    }

    public static func decode(_ text: String) -> [UInt8]? {
        decoded(text.utf8.lazy.filter { $0 != UInt8(ascii: "=") }, url: false)
    }

    /// The six bits `byte` stands for in the standard (`url` false) or base64url alphabet; nil
    /// for a byte of neither.
    @inline(__always)
    private static func value(_ byte: UInt8, url: Bool) -> UInt8? {
        switch byte {
        case 0x41...0x5A: return byte - 0x41
        case 0x61...0x7A: return byte - 0x61 + 26
        case 0x30...0x39: return byte - 0x30 + 52
        case UInt8(ascii: "+") where !url, UInt8(ascii: "-") where url: return 62
        case UInt8(ascii: "/") where !url, UInt8(ascii: "_") where url: return 63
        default: return nil
        }
    }

    /// The bytes of `characters` (no padding among them), four characters to three bytes, a
    /// last group of two or three characters to one or two.
    private static func decoded(_ characters: some Sequence<UInt8>, url: Bool) -> [UInt8]? {
        var output: [UInt8] = []
        output.reserveCapacity(characters.underestimatedCount * 3 / 4 + 3)
        var group: UInt32 = 0
        var count = 0
        for byte in characters {
            guard let bits = value(byte, url: url) else { return nil }
            group = group << 6 | UInt32(bits)
            count += 1
            if count == 4 {
                output.append(UInt8(truncatingIfNeeded: group >> 16))
                output.append(UInt8(truncatingIfNeeded: group >> 8))
                output.append(UInt8(truncatingIfNeeded: group))
                (group, count) = (0, 0)
            }
        }
        switch count {
        case 2: output.append(UInt8(truncatingIfNeeded: group >> 4))
        case 3:
            output.append(UInt8(truncatingIfNeeded: group >> 10))
            output.append(UInt8(truncatingIfNeeded: group >> 2))
        default: break   // (one character alone encodes no byte: dropped, as before)
        }
        return output
    }
}
