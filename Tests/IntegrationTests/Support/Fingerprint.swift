import WireJSON

/// A short, stable fingerprint of a token, so that tests compare and report tokens without
/// printing them (FNV-1a, 32 bits).
func fp(_ token: String?) -> String {
    guard let token else { return "none" }
    var hash: UInt32 = 0x811C_9DC5
    for byte in token.utf8 {
        hash ^= UInt32(byte)
        hash = hash &* 0x0100_0193
    }
    return "fp:" + String(hash, radix: 16)
}

func fp(_ value: JSON?) -> String { fp(value?.stringValue) }
