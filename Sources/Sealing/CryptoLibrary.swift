import CCrypto

/// libcrypto, which the daemon does not link but loads (`CCrypto`): the first call into it
/// loads it, or `load()` does ahead of that.
public enum CryptoLibrary {
    /// Loads libcrypto.so.3 now, if nothing has yet. Returns why it could not (the first call
    /// into libcrypto then tries again, and ends the process if it still cannot).
    public static func load() -> String? {
        var reason = [CChar](repeating: 0, count: 256)
        guard tb_crypto_try_load(&reason, reason.count) != 0 else { return nil }
        return String(decoding: reason.prefix(while: { $0 != 0 }).map { UInt8(bitPattern: $0) }, as: UTF8.self)
    }
}
