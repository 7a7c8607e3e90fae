#if canImport(Glibc)
import Glibc
#endif
import CLinux

/// What `serve` does to its own process before it reads a secret, and what it checks about the
/// identity the kernel will report for its peers.
enum ProcessDefences {
    /// Makes the process undumpable (`PR_SET_DUMPABLE` 0): a crash writes no core file (tokens,
    /// client secrets and the state key live in its memory), and processes of the same uid can
    /// neither ptrace it nor read its `/proc/PID/mem` or `environ`. Returns whether it took.
    static func makeUndumpable() -> Bool {
        tb_set_undumpable() == 0 && tb_is_dumpable() == 0
    }

    /// The uid the kernel reports for an id that has no mapping in the observer's user namespace
    /// (`/proc/sys/kernel/overflowuid`, 65534 unless changed). A peer reported with it is
    /// *somebody* outside the map, never a particular user.
    static let overflowUID: UInt32 = readNumber("/proc/sys/kernel/overflowuid") ?? 65534
    /// The same for gids (`/proc/sys/kernel/overflowgid`).
    static let overflowGID: UInt32 = readNumber("/proc/sys/kernel/overflowgid") ?? 65534

    /// Whether every uid and gid is mapped to itself, i.e. this process is in the initial user
    /// namespace (or one equivalent to it), so `SO_PEERCRED` and `SO_PEERGROUPS` report real ids.
    /// `nil` when the maps cannot be read.
    static func idsAreIdentityMapped() -> Bool? {
        guard case let .success(uids) = FileSystem.readText("/proc/self/uid_map"),
              case let .success(gids) = FileSystem.readText("/proc/self/gid_map") else { return nil }
        return isIdentityMap(uids) && isIdentityMap(gids)
    }

    /// Whether a `uid_map`/`gid_map` text maps every id to itself: one line `0 0 4294967295`.
    static func isIdentityMap(_ text: String) -> Bool {
        let lines = text.split(separator: "\n").map { $0.split(separator: " ", omittingEmptySubsequences: true) }
        return lines.count == 1 && lines[0] == ["0", "0", "4294967295"]
    }

    /// The warning `serve` logs when peers' ids cannot be trusted.
    static let userNamespaceWarning = "this process runs in a user namespace that does not map every uid and gid "
        + "(e.g. PrivateUsers=yes): peers outside it are reported as uid \(overflowUID)/gid \(overflowGID), so "
        + "AllowUsers= and AllowGroups= cannot match them; only root and the daemon's own user are recognised"

    private static func readNumber(_ path: String) -> UInt32? {
        guard case let .success(text) = FileSystem.readText(path) else { return nil }
        return UInt32(text.split(separator: "\n").first ?? "")
    }
}
