import Basics
import Testing
import TestSupport

/// Base64 and base64url (RFC 4648 §4, §5), against a reference decoder written the slow way.
@Suite("Base64")
struct Base64Tests {
    /// The reference: each character looked up in its alphabet.
    static func reference(_ text: String, alphabet: String) -> [UInt8]? {
        let letters = Array(alphabet.utf8)
        var values: [UInt8] = []
        for byte in text.utf8 where byte != UInt8(ascii: "=") {
            guard let index = letters.firstIndex(of: byte) else { return nil }
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

    static let standard = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    static let url = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"

    @Test("round trips of every length to 300 bytes, both alphabets; the decoders agree with the reference on 20,000 random texts, valid or not")
    func decoders() {
        var random = SeededRandom(seed: 37)
        for length in 0...300 {
            let bytes = (0..<length).map { _ in UInt8.random(in: 0...255, using: &random) }
            #expect(Base64.decode(Base64.encode(bytes)) == bytes)
            #expect(Base64.urlDecode(Base64.urlEncode(bytes)) == bytes)
        }
        let characters = Array((Self.standard + "-_=.!é ").unicodeScalars)
        for _ in 0..<20_000 {
            let text = String(String.UnicodeScalarView((0..<Int.random(in: 0...24, using: &random)).map { _ in characters.randomElement(using: &random)! }))
            #expect(Base64.decode(text) == Self.reference(text, alphabet: Self.standard), "\(text)")
            let strict = text.utf8.count % 4 == 1 || text.contains("=") ? nil : Self.reference(text, alphabet: Self.url)
            #expect(Base64.urlDecode(text) == strict, "\(text)")
        }
    }
}
