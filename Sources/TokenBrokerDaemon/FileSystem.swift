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
        return readAll(fd, path)
    }

    /// A secret file's content (at most 16 MiB) and who may read it, from the file it opened
    /// (`fstat`, not a second look up of the path): `flags` adds to `O_RDONLY` (`O_NOFOLLOW`).
    static func readSecret(_ path: String, flags: Int32 = 0) -> Result<(bytes: [UInt8], access: SecretFileAccess, owner: uid_t), SocketError> {
        let fd = open(path, O_RDONLY | O_CLOEXEC | flags)
        guard fd >= 0 else { return .failure(SocketError("open \(path)")) }
        defer { close(fd) }
        var info = stat()
        guard fstat(fd, &info) == 0 else { return .failure(SocketError("stat \(path)")) }
        return readAll(fd, path).map { ($0, SecretFileAccess(info), info.st_uid) }
    }

    private static func readAll(_ fd: Int32, _ path: String) -> Result<[UInt8], SocketError> {
        var bytes: [UInt8] = []
        // Read through a chunk that is not zeroed first (a 64 KB zeroed array per file was
        // 400,000 instructions of a start, and its pages), and cleared of what it held after:
        // some of these files are secrets.
        let chunk = UnsafeMutableRawBufferPointer.allocate(byteCount: 16_384, alignment: 16)
        var used = 0
        defer {
            explicit_bzero(chunk.baseAddress!, used)
            chunk.deallocate()
        }
        while bytes.count < 16 << 20 {
            let n = read(fd, chunk.baseAddress, chunk.count)
            if n > 0 {
                used = max(used, n)
                bytes.append(contentsOf: UnsafeRawBufferPointer(rebasing: chunk[0..<n]))
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

/// Who besides its owner may read a file that holds a secret (`ClientSecretFile=`,
/// `StateKeyFile=`, a TLS key…). Readable by every user is refused, as ssh refuses such a
/// private key; readable by its group is allowed with a warning (the daemon's group may be
/// meant to read it — but workers are in group tokenbroker, to reach the socket).
enum SecretFileAccess: Sendable, Equatable {
    /// Its owner only (or not a regular file: a pipe, a device).
    case owner
    case group(gid_t, mode: mode_t)
    case everyone(mode: mode_t)

    init(_ info: stat) {
        let mode = info.st_mode & 0o7777
        if info.st_mode & S_IFMT != S_IFREG {
            self = .owner
        } else if mode & 0o004 != 0 {
            self = .everyone(mode: mode)
        } else if mode & 0o040 != 0 {
            self = .group(info.st_gid, mode: mode)
        } else {
            self = .owner
        }
    }

    /// The refusal for a file anyone may read, naming it and its mode.
    func refusal(_ path: String) -> String? {
        guard case let .everyone(mode) = self else { return nil }
        return "\(path) is readable by every user (mode \(Self.octal(mode))): refusing a secret in it; make it readable by its owner "
            + "only (chmod 600 \(path))"
    }

    /// The warning for a file its group may read, naming it, the group and its mode.
    func warning(_ path: String) -> String? {
        guard case let .group(gid, mode) = self else { return nil }
        let group = Identity.groupName(gid).map { "group \($0)" } ?? "gid \(gid)"
        return "\(path) is readable by \(group) (mode \(Self.octal(mode))): every member can read the secret; "
            + "chmod 600 \(path) unless that is meant"
    }

    /// `0640`: a mode as chmod takes it.
    static func octal(_ mode: mode_t) -> String {
        let digits = String(mode, radix: 8)
        return String(repeating: "0", count: max(0, 4 - digits.count)) + digits
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

    static func groupName(_ id: gid_t) -> String? {
        var entry = group()
        var result: UnsafeMutablePointer<group>?
        var buffer = [CChar](repeating: 0, count: 65_536)
        guard getgrgid_r(id, &entry, &buffer, buffer.count, &result) == 0, result != nil, let name = entry.gr_name else { return nil }
        return String(cString: name)
    }

    static func groupID(_ name: String) -> UInt32? {
        var entry = group()
        var result: UnsafeMutablePointer<group>?
        var buffer = [CChar](repeating: 0, count: 65_536)
        guard getgrnam_r(name, &entry, &buffer, buffer.count, &result) == 0, result != nil else { return nil }
        return entry.gr_gid
    }
}
