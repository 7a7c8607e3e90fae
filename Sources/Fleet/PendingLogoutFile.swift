#if canImport(Glibc)
import Glibc
#endif

/// A small file that remembers a logout etcd has not taken yet, so that a restart does not
/// forget it: written durably (temporary file, fsync, rename, fsync of the directory), read
/// bounded, removed once the fleet has it.
enum PendingLogoutFile {
    /// The file's text (at most 64 bytes, trailing whitespace dropped), or nil when there is none.
    static func read(_ path: String) -> String? {
        let fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW)
        guard fd >= 0 else { return nil }
        defer { close(fd) }
        var buffer = [UInt8](repeating: 0, count: 64)
        let count = Glibc.read(fd, &buffer, buffer.count)
        guard count >= 0 else { return nil }
        var text = Substring(String(decoding: buffer[..<count], as: UTF8.self))
        while let last = text.last, last.isWhitespace { text = text.dropLast() }
        return String(text)
    }

    /// Returns whether the text is durable.
    static func write(_ path: String, _ text: String) -> Bool {
        let temporary = path + ".tmp"
        let fd = open(temporary, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0o600)
        guard fd >= 0 else { return false }
        let bytes = Array((text + "\n").utf8)
        let written = bytes.withUnsafeBytes { Glibc.write(fd, $0.baseAddress, $0.count) }
        let synced = fsync(fd) == 0
        close(fd)
        guard written == bytes.count, synced, rename(temporary, path) == 0 else {
            unlink(temporary)
            return false
        }
        return syncDirectory(of: path)
    }

    /// A logout's generation as the file names it: `-` (the newest), `<generation>` (of the
    /// first history) or `<history>:<generation>`; nil when it is none of these.
    static func generation(_ text: Substring) -> FleetGeneration? {
        let parts = text.split(separator: ":", omittingEmptySubsequences: false)
        guard let generation = parts.last.flatMap({ Int64($0) }), parts.count <= 2 else { return nil }
        guard parts.count == 2 else { return FleetGeneration(generation: generation) }
        return Int64(parts[0]).map { FleetGeneration(history: $0, generation: generation) }
    }

    /// The text that names `generation` (nil: the newest).
    static func text(_ generation: FleetGeneration?) -> String {
        guard let generation else { return "-" }
        return generation.history > 0 ? "\(generation.history):\(generation.generation)" : String(generation.generation)
    }

    static func remove(_ path: String) {
        if unlink(path) == 0 { _ = syncDirectory(of: path) }
    }

    private static func syncDirectory(of path: String) -> Bool {
        let directory = path.lastIndex(of: "/").map { String(path[..<$0]) } ?? "."
        let fd = open(directory.isEmpty ? "/" : directory, O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        guard fd >= 0 else { return false }
        defer { close(fd) }
        return fsync(fd) == 0
    }
}
