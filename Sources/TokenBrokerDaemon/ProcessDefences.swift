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
    /// This host's name (`gethostname`), or "localhost".
    static func hostName() -> String {
        var buffer = [CChar](repeating: 0, count: 256)
        guard gethostname(&buffer, buffer.count - 1) == 0 else { return "localhost" }
        let name = String(decoding: buffer.prefix { $0 != 0 }.map { UInt8(bitPattern: $0) }, as: UTF8.self)
        return name.isEmpty || name.utf8.count > 64 ? "localhost" : name
    }

    static func makeUndumpable() -> Bool {
        tb_set_undumpable() == 0 && tb_is_dumpable() == 0
    }

    /// The uid the kernel reports for an id that has no mapping in the observer's user namespace
    /// (`/proc/sys/kernel/overflowuid`, 65534 unless changed). A peer reported with it is
    /// *somebody* outside the map, never a particular user.
    static let overflowUID: UInt32 = readNumber("/proc/sys/kernel/overflowuid") ?? 65534
    /// The same for gids (`/proc/sys/kernel/overflowgid`).
    static let overflowGID: UInt32 = readNumber("/proc/sys/kernel/overflowgid") ?? 65534

    /// The ids of this process's user namespace that have a mapping to the initial one
    /// (`/proc/self/uid_map`, `gid_map`): a peer whose id is outside them is reported as the
    /// overflow id, so an allow list naming such an id can never match.
    struct IDMap: Equatable {
        /// `(first id inside, count)` per line.
        var ranges: [(first: UInt32, count: UInt32)]

        /// Parses a `uid_map`/`gid_map` text; `nil` when it is not one.
        init?(_ text: String) {
            var ranges: [(first: UInt32, count: UInt32)] = []
            for line in text.split(separator: "\n") {
                let fields = line.split(separator: " ", omittingEmptySubsequences: true)
                guard fields.count == 3, let first = UInt32(fields[0]), UInt32(fields[1]) != nil, let count = UInt32(fields[2]) else {
                    return nil
                }
                ranges.append((first, count))
            }
            self.ranges = ranges
        }

        func contains(_ id: UInt32) -> Bool {
            ranges.contains { id >= $0.first && UInt64(id) < UInt64($0.first) + UInt64($0.count) }
        }

        static func == (lhs: IDMap, rhs: IDMap) -> Bool {
            lhs.ranges.elementsEqual(rhs.ranges) { $0.first == $1.first && $0.count == $1.count }
        }
    }

    /// Warnings for the ids a configuration names that no peer can ever be reported with,
    /// because this process's user namespace does not map them (e.g. under `PrivateUsers=yes`).
    /// Empty in the initial namespace, or in a container that maps every id it uses.
    static func unmappedIDWarnings(_ configuration: BrokerConfiguration,
                                   uidMap: IDMap? = readMap("/proc/self/uid_map"),
                                   gidMap: IDMap? = readMap("/proc/self/gid_map")) -> [String] {
        var warnings: [String] = []
        func check(_ ids: [UInt32], _ map: IDMap?, _ what: String, overflow: UInt32) {
            guard let map else { return }
            // (The overflow id itself has its own warning at configuration load.)
            for id in Set(ids).sorted() where !map.contains(id) && id != overflow {
                warnings.append("\(what) \(id) has no mapping in this process's user namespace (e.g. PrivateUsers=yes): "
                                + "peers with it are reported as \(overflow) and can never match")
            }
        }
        let sessions = configuration.sessions
        check(sessions.flatMap(\.allowUsers), uidMap, "uid", overflow: overflowUID)
        check(sessions.flatMap(\.allowGroups) + (configuration.adminGroup.map { [$0] } ?? []), gidMap, "gid", overflow: overflowGID)
        return warnings
    }

    static func readMap(_ path: String) -> IDMap? {
        guard case let .success(text) = FileSystem.readText(path) else { return nil }
        return IDMap(text)
    }

    private static func readNumber(_ path: String) -> UInt32? {
        guard case let .success(text) = FileSystem.readText(path) else { return nil }
        return UInt32(text.split(separator: "\n").first ?? "")
    }
}
