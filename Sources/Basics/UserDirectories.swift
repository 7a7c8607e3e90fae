#if canImport(Glibc)
import Glibc
#endif

/// A user's own directories, as the XDG Base Directory specification (and systemd's user
/// manager) places them: each from its variable when that is an absolute path, else the
/// specification's default under `$HOME` (or, for the runtime directory, `/run/user/UID`).
public struct UserDirectories: Sendable, Equatable {
    public var runtime: String
    public var config: String
    public var state: String

    public init(variable: (String) -> String? = { getenv($0).map { String(cString: $0) } }, uid: UInt32 = getuid()) {
        func absolute(_ name: String) -> String? { variable(name).flatMap { $0.hasPrefix("/") ? $0 : nil } }
        let home = absolute("HOME") ?? Self.passwdHome(uid) ?? "/"
        runtime = absolute("XDG_RUNTIME_DIR") ?? "/run/user/\(uid)"
        config = absolute("XDG_CONFIG_HOME") ?? (home == "/" ? "" : home) + "/.config"
        state = absolute("XDG_STATE_HOME") ?? (home == "/" ? "" : home) + "/.local/state"
    }

    /// The home directory the password database gives `uid` (nil: none).
    private static func passwdHome(_ uid: UInt32) -> String? {
        var entry = passwd()
        var found: UnsafeMutablePointer<passwd>?
        var buffer = [CChar](repeating: 0, count: 4096)
        guard getpwuid_r(uid, &entry, &buffer, buffer.count, &found) == 0, found != nil, let directory = entry.pw_dir else { return nil }
        let home = String(cString: directory)
        return home.hasPrefix("/") ? home : nil
    }
}
