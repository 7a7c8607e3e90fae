import CCrypto

/// libcrypto, which the daemon does not link but loads (`CCrypto`): the first call into it
/// loads it, or `load()` does ahead of that.
public enum CryptoLibrary {
    /// Loads libcrypto.so.3 now, if no call has yet (it ends the process if it cannot, as the
    /// dynamic loader did at exec when the daemon linked it).
    public static func load() { tb_crypto_load() }
}
