import Foundation
#if canImport(Glibc)
import Glibc
#endif

/// A file holding a secret (a client secret, a key, a bearer token) as an operator writes one:
/// readable by its owner only. (The daemon refuses a secret file every user may read.)
public enum SecretFile {
    /// Writes `text` to `path` with mode 0600, whatever the umask.
    public static func write(_ text: String, to path: String) throws {
        try text.write(toFile: path, atomically: true, encoding: .utf8)
        guard chmod(path, 0o600) == 0 else { throw CocoaError(.fileWriteNoPermission, userInfo: [NSFilePathErrorKey: path]) }
    }
}
