import Basics
import CCrypto

/// Seals values with AES-256-GCM under a key the operator provides (a systemd credential or a
/// file): the token columns of the state database (under the state key), and everything a fleet
/// shares through etcd (under the fleet key). A copy of either alone reveals no token.
///
/// A value is `tbenc1:` + Base64(nonce ‖ ciphertext ‖ tag), with a fresh 96-bit nonce per value
/// and the caller's associated data (where the value belongs: a row and column, an etcd key): a
/// ciphertext moved elsewhere fails to open.
public struct TokenCipher: Sendable {
    public struct Failure: Error, Sendable, Equatable, CustomStringConvertible {
        public var description: String
        public init(_ description: String) { self.description = description }
    }

    /// What every sealed value starts with.
    public static let sealedPrefix = "tbenc1:"
    static let prefix = sealedPrefix
    private let key: [UInt8]
    /// What the key is called where operators configure it ("state key", "fleet key"), for the
    /// message of a value that does not open.
    public let keyName: String

    /// The key: exactly 32 bytes, or 64 hexadecimal digits (surrounding whitespace ignored).
    public init(keyMaterial: [UInt8], name: String = "state key") throws(Failure) {
        keyName = name
        var bytes = keyMaterial
        while let last = bytes.last, last == 0x0A || last == 0x0D || last == 0x20 { bytes.removeLast() }
        if bytes.count == 32 {
            key = bytes
            return
        }
        let text = String(decoding: bytes, as: UTF8.self)
        guard text.count == 64, let decoded = Self.hex(text) else {
            throw Failure("the key must be 32 bytes or 64 hexadecimal digits")
        }
        key = decoded
    }

    /// A new key from libcrypto's random generator, as 64 hexadecimal digits (text, so that no
    /// byte of it is a trailing newline the reader would drop).
    public static func newKeyMaterial() throws(Failure) -> [UInt8] {
        var bytes = [UInt8](repeating: 0, count: 32)
        guard RAND_bytes(&bytes, 32) == 1 else { throw Failure("no random bytes for a new key") }
        let digits = Array("0123456789abcdef".utf8)
        return bytes.flatMap { [digits[Int($0 >> 4)], digits[Int($0 & 0x0F)]] }
    }

    public static func isEncrypted(_ value: String) -> Bool { value.hasPrefix(prefix) }

    public func seal(_ plaintext: String, associatedData: String) throws(Failure) -> String {
        var nonce = [UInt8](repeating: 0, count: 12)
        guard RAND_bytes(&nonce, 12) == 1 else { throw Failure("no random bytes for a nonce") }
        let input = Array(plaintext.utf8)
        var output = [UInt8](repeating: 0, count: input.count)
        var tag = [UInt8](repeating: 0, count: 16)
        try crypt(encrypt: true, nonce: nonce, input: input, output: &output, tag: &tag, associatedData: Array(associatedData.utf8))
        return Self.prefix + Base64.encode(nonce + output + tag)
    }

    public func open(_ sealed: String, associatedData: String) throws(Failure) -> String {
        guard sealed.hasPrefix(Self.prefix), let bytes = Base64.decode(String(sealed.dropFirst(Self.prefix.count))), bytes.count >= 28 else {
            throw Failure("a value that is not sealed")
        }
        let nonce = Array(bytes[0..<12])
        let input = Array(bytes[12..<(bytes.count - 16)])
        var tag = Array(bytes[(bytes.count - 16)...])
        var output = [UInt8](repeating: 0, count: input.count)
        try crypt(encrypt: false, nonce: nonce, input: input, output: &output, tag: &tag, associatedData: Array(associatedData.utf8))
        return String(decoding: output, as: UTF8.self)
    }

    private func crypt(encrypt: Bool, nonce: [UInt8], input: [UInt8], output: inout [UInt8], tag: inout [UInt8],
                       associatedData: [UInt8]) throws(Failure) {
        guard let context = EVP_CIPHER_CTX_new() else { throw Failure("EVP_CIPHER_CTX_new failed") }
        defer { EVP_CIPHER_CTX_free(context) }
        var length: Int32 = 0
        let cipher = EVP_aes_256_gcm()
        let initialised = encrypt ? EVP_EncryptInit_ex(context, cipher, nil, key, nonce) : EVP_DecryptInit_ex(context, cipher, nil, key, nonce)
        guard initialised == 1 else { throw Failure("cipher initialisation failed") }
        if !associatedData.isEmpty {
            let rc = encrypt ? EVP_EncryptUpdate(context, nil, &length, associatedData, Int32(associatedData.count))
                             : EVP_DecryptUpdate(context, nil, &length, associatedData, Int32(associatedData.count))
            guard rc == 1 else { throw Failure("cipher failed") }
        }
        if !input.isEmpty {
            let rc = output.withUnsafeMutableBufferPointer { buffer in
                encrypt ? EVP_EncryptUpdate(context, buffer.baseAddress, &length, input, Int32(input.count))
                        : EVP_DecryptUpdate(context, buffer.baseAddress, &length, input, Int32(input.count))
            }
            guard rc == 1 else { throw Failure("cipher failed") }
        }
        var scratch = [UInt8](repeating: 0, count: 16)
        if encrypt {
            guard EVP_EncryptFinal_ex(context, &scratch, &length) == 1,
                  EVP_CIPHER_CTX_ctrl(context, EVP_CTRL_GCM_GET_TAG, 16, &tag) == 1 else { throw Failure("cipher failed") }
        } else {
            guard EVP_CIPHER_CTX_ctrl(context, EVP_CTRL_GCM_SET_TAG, 16, &tag) == 1,
                  EVP_DecryptFinal_ex(context, &scratch, &length) == 1 else {
                throw Failure("a value that does not decrypt with this \(keyName) (wrong key, or the value was moved or altered)")
            }
        }
    }

    private static func hex(_ text: String) -> [UInt8]? {
        var bytes: [UInt8] = []
        var iterator = text.makeIterator()
        while let high = iterator.next(), let low = iterator.next() {
            guard let value = UInt8(String([high, low]), radix: 16) else { return nil }
            bytes.append(value)
        }
        return bytes.count == 32 ? bytes : nil
    }
}
