#if canImport(Glibc)
import Glibc
#endif
import Varlink

/// The few file operations the daemon needs, without Foundation.
enum FileSystem {
    /// The whole file as UTF-8 text (at most 16 MiB).
    static func readText(_ path: String) -> Result<String, SocketError> {
        readBytes(path).map { String(decoding: $0, as: UTF8.self) }
    }

    /// The whole file (at most 16 MiB).
    static func readBytes(_ path: String) -> Result<[UInt8], SocketError> {
        let fd = open(path, O_RDONLY | O_CLOEXEC)
        guard fd >= 0 else { return .failure(SocketError("open \(path)")) }
        defer { close(fd) }
        var bytes: [UInt8] = []
        var chunk = [UInt8](repeating: 0, count: 65_536)
        while bytes.count < 16 << 20 {
            let n = chunk.withUnsafeMutableBytes { read(fd, $0.baseAddress, $0.count) }
            if n > 0 {
                bytes += chunk[0..<n]
            } else if n == 0 {
                break
            } else if errno != EINTR {
                return .failure(SocketError("read \(path)"))
            }
        }
        return .success(bytes)
    }

    /// Names in a directory (empty when it does not exist).
    static func list(_ path: String) -> [String] {
        guard let directory = opendir(path) else { return [] }
        defer { closedir(directory) }
        var names: [String] = []
        while let entry = readdir(directory) {
            let name = withUnsafeBytes(of: entry.pointee.d_name) { raw in
                String(decoding: raw.prefix { $0 != 0 }, as: UTF8.self)
            }
            if name != "." && name != ".." { names.append(name) }
        }
        return names
    }
}

/// User and group lookups through NSS.
enum Identity {
    static func userID(_ name: String) -> UInt32? {
        var entry = passwd()
        var result: UnsafeMutablePointer<passwd>?
        var buffer = [CChar](repeating: 0, count: 16_384)
        guard getpwnam_r(name, &entry, &buffer, buffer.count, &result) == 0, result != nil else { return nil }
        return entry.pw_uid
    }

    static func groupID(_ name: String) -> UInt32? {
        var entry = group()
        var result: UnsafeMutablePointer<group>?
        var buffer = [CChar](repeating: 0, count: 65_536)
        guard getgrnam_r(name, &entry, &buffer, buffer.count, &result) == 0, result != nil else { return nil }
        return entry.gr_gid
    }
}
