#if canImport(Glibc)
import Glibc
#endif
import BrokerContract
import CLinux
import TokenBrokerCore
import Varlink

/// The file operations of a token file (`[Output]`, `ctl delegate --file`), blocking: run on
/// the token files' own thread, never on the cooperative pool.
///
/// A file is only ever replaced whole: its content goes to a temporary file in the same
/// directory (created exclusively, never following a link), which gets its owner, mode and ACL,
/// is fsync'd and then renamed over the path, and the directory is fsync'd — a reader sees the
/// old token or the new one, never a part. Nothing is written where someone other than root or
/// the daemon's user could change the directory (checked as for sockets, `SocketPath`), and a
/// path that holds anything but a regular file (a symlink planted there, a directory) is
/// refused, not replaced. At the end (a logout, the output removed) the file is overwritten
/// with zeros, fsync'd, truncated and removed.
enum TokenFileWriter {
    enum Failure: Error, CustomStringConvertible, Equatable {
        case unsafeDirectory(String, String)
        case notAFile(String, String)
        case unwritable(String)
        case system(String)

        var description: String {
            switch self {
            case let .unsafeDirectory(directory, why):
                return "\(directory): \(why); a token file must live in a directory only root or this daemon's user can change"
            case let .notAFile(path, what): return "\(path) is \(what): refusing to write a token through or over it"
            case let .unwritable(why): return why
            case let .system(why): return why
            }
        }
    }

    /// The file's content for `token` in `format` (bytes the caller wipes after use), or nil
    /// when the token holds a byte a line of text (an HTTP header) could not carry.
    static func content(_ token: IssuedToken, _ format: TokenFileFormat) -> [UInt8]? {
        let value = token.token.reveal
        guard !value.isEmpty, value.utf8.allSatisfy({ $0 > 0x20 && $0 < 0x7F }) else { return nil }
        let type = token.tokenType.lowercased() == "bearer" ? "Bearer" : token.tokenType
        guard type.utf8.allSatisfy({ $0 > 0x20 && $0 < 0x7F }) else { return nil }
        switch format {
        case .token: return Array(value.utf8) + [0x0A]
        case .header: return Array("Authorization: \(type) ".utf8) + Array(value.utf8) + [0x0A]
        case .json:
            var object: JSONObject = ["access_token": .string(value), "token_type": .string(type), "serial": .int(Int64(token.serial))]
            if let expiresAt = token.expiresAt { object["expires_at"] = .int(expiresAt) }
            return Array(JSON.object(object).text.utf8) + [0x0A]
        }
    }

    /// Puts `bytes` at `file.path` as described above; returns the new file's inode.
    static func write(_ bytes: [UInt8], _ file: TokenFileConfiguration) throws(Failure) -> ino_t {
        let (directory, name) = try open(file.path, creatingParents: true)
        defer { close(directory) }
        try checkTarget(directory, name, file.path)
        let (fd, temporary) = try prepare(directory, name, bytes, file)
        var done = false
        defer {
            close(fd)
            if !done { unlinkat(directory, temporary, 0) }
        }
        var info = stat()
        guard fstat(fd, &info) == 0 else { throw .system("stat \(file.path): \(errorText())") }
        // (Checked again just before: the directory is root's or the daemon's alone, but a
        // path that became a symlink or a directory is never replaced.)
        try checkTarget(directory, name, file.path)
        guard renameat(directory, temporary, directory, name) == 0 else { throw .system("rename onto \(file.path): \(errorText())") }
        done = true
        fsync(directory)
        return info.st_ino
    }

    /// A temporary file beside `name`, made exclusively, holding `bytes` with the file's owner,
    /// mode and ACL, fsync'd: open, for the caller to rename (or remove) and close.
    private static func prepare(_ directory: Int32, _ name: String, _ bytes: [UInt8], _ file: TokenFileConfiguration) throws(Failure)
        -> (Int32, String) {
        var temporary = ""
        var fd: Int32 = -1
        for _ in 0..<8 {
            temporary = temporaryPrefix(name) + String(UInt64.random(in: 0...UInt64.max), radix: 36)
            fd = openat(directory, temporary, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0o600)
            if fd >= 0 || errno != EEXIST { break }
        }
        guard fd >= 0 else { throw .system("create a temporary file in \(parent(of: file.path)): \(errorText())") }
        do throws(Failure) {
            try writeAll(fd, bytes, file.path)
            if file.user != nil || file.group != nil,
               fchown(fd, file.user.map { uid_t($0) } ?? uid_t.max, file.group.map { gid_t($0) } ?? gid_t.max) != 0 {
                let whom = [file.user.map { "user \($0)" }, file.group.map { "group \($0)" }].compactMap { $0 }.joined(separator: ", ")
                throw .unwritable("\(file.path): cannot give it to \(whom): \(errorText())"
                                  + (errno == EPERM ? " (another owner needs a daemon run as root; Readers= needs no privilege)" : ""))
            }
            guard fchmod(fd, mode_t(file.mode)) == 0 else { throw .system("chmod \(file.path): \(errorText())") }
            if !file.readers.isEmpty {
                let acl = accessACL(mode: file.mode, readers: file.readers)
                let set = acl.withUnsafeBytes { tb_fsetxattr(fd, "system.posix_acl_access", $0.baseAddress, $0.count) }
                guard set == 0 else {
                    throw .unwritable("\(file.path): cannot give its readers access (a POSIX ACL): \(errorText())"
                                      + (errno == EOPNOTSUPP ? " (the file system has no ACLs; use Group= instead)" : ""))
                }
            }
            guard fsync(fd) == 0 else { throw .system("fsync \(file.path): \(errorText())") }
            return (fd, temporary)
        } catch {
            close(fd)
            unlinkat(directory, temporary, 0)
            throw error
        }
    }

    /// The temporary files of `name` start so (a crash can leave one: `check` removes them).
    private static func temporaryPrefix(_ name: String) -> String { "." + name.prefix(200) + ".tokenbroker-" }

    /// What would stop a write to `file.path` now (its directories made where missing): a
    /// directory others can change or a symlink on the way, something other than a regular
    /// file at the path, an owner or ACL the daemon cannot give (tried on a temporary file,
    /// with no token in it). Temporary files a crash left beside it are removed.
    static func check(_ file: TokenFileConfiguration) -> Failure? {
        do throws(Failure) {
            let (directory, name) = try open(file.path, creatingParents: true)
            defer { close(directory) }
            try checkTarget(directory, name, file.path)
            let prefix = temporaryPrefix(name)
            for entry in FileSystem.list(parent(of: file.path)) where entry.hasPrefix(prefix) {
                var info = stat()
                if fstatat(directory, entry, &info, AT_SYMLINK_NOFOLLOW) == 0, info.st_mode & S_IFMT == S_IFREG { unlinkat(directory, entry, 0) }
            }
            let (fd, temporary) = try prepare(directory, name, [], file)
            close(fd)
            unlinkat(directory, temporary, 0)
            return nil
        } catch {
            return error
        }
    }

    /// Removes the regular file at `path`, then overwrites what it held with zeros and fsyncs
    /// it (a reader that still has it open finds nothing left), whatever its mode. Nothing
    /// there: nothing to do. Something there that is not a regular file is left alone (it was
    /// never the broker's). A directory that cannot be opened safely is a failure: the file
    /// may still hold its token.
    @discardableResult
    static func erase(_ path: String) -> Failure? {
        let directory: Int32, name: String
        do {
            (directory, name) = try open(path, creatingParents: false)
        } catch .system(let why) where why.hasSuffix(": \(String(cString: strerror(ENOENT)))") {
            return nil   // (no directory: no file)
        } catch {
            return error
        }
        defer { close(directory) }
        // Read-only is enough to hold it: a file of mode 0400 is erased too.
        let fd = openat(directory, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC)
        guard fd >= 0 else {
            switch errno {
            case ENOENT: return nil
            case ELOOP: return .notAFile(path, "a symlink")
            default: return .system("open \(path) to erase it: \(errorText())")
            }
        }
        defer { close(fd) }
        var info = stat()
        guard fstat(fd, &info) == 0, info.st_mode & S_IFMT == S_IFREG else { return .notAFile(path, "not a regular file") }
        guard unlinkat(directory, name, 0) == 0 || errno == ENOENT else { return .system("remove \(path): \(errorText())") }
        fsync(directory)
        // Its content, zeroed through a descriptor that may write (the daemon owns it, or is root).
        fchmod(fd, 0o600)
        let writable = Glibc.open("/proc/self/fd/\(fd)", O_WRONLY | O_CLOEXEC)
        if writable >= 0 {
            defer { close(writable) }
            let size = Int(min(info.st_size, 1 << 16))
            let zeros = [UInt8](repeating: 0, count: size)
            _ = zeros.withUnsafeBytes { pwrite(writable, $0.baseAddress, size, 0) }
            fsync(writable)
            ftruncate(writable, 0)
        }
        return nil
    }

    /// The POSIX ACL (`system.posix_acl_access`, the kernel's xattr form: version 2, then
    /// tag/perm/id entries in tag order) that gives `readers` read access besides the mode's.
    static func accessACL(mode: UInt32, readers: [UInt32]) -> [UInt8] {
        var bytes: [UInt8] = []
        func append(_ value: UInt32, _ width: Int) { for shift in stride(from: 0, to: width * 8, by: 8) { bytes.append(UInt8((value >> UInt32(shift)) & 0xFF)) } }
        func entry(_ tag: UInt32, _ perm: UInt32, _ id: UInt32) { append(tag, 2); append(perm, 2); append(id, 4) }
        let undefined = UInt32.max
        append(2, 4)
        entry(0x01, (mode >> 6) & 7, undefined)                              // ACL_USER_OBJ
        for reader in Set(readers).sorted() { entry(0x02, 4, reader) }       // ACL_USER: read
        entry(0x04, (mode >> 3) & 7, undefined)                              // ACL_GROUP_OBJ
        entry(0x10, ((mode >> 3) & 7) | 4, undefined)                        // ACL_MASK
        entry(0x20, mode & 7, undefined)                                     // ACL_OTHER
        return bytes
    }

    /// The file's directory, opened (never through a symlink) once it and those above it are
    /// checked, and the file's name in it. A path with a symlink on the way is refused (a link
    /// re-pointed would move the file); missing directories are made (0755) only below one
    /// that is safe.
    private static func open(_ path: String, creatingParents: Bool) throws(Failure) -> (Int32, String) {
        let directory = parent(of: path)
        do {
            if creatingParents {
                var existing = directory
                var missing: [String] = []
                var info = stat()
                while lstat(existing, &info) != 0 {
                    guard errno == ENOENT else { throw Failure.system("lstat \(existing): \(errorText())") }
                    missing.append(existing)
                    existing = parent(of: existing)
                }
                if !missing.isEmpty {
                    try checkResolved(existing)
                    try SocketPath.checkDirectories(above: existing + "/.")
                    for made in missing.reversed() {
                        guard mkdir(made, 0o755) == 0 || errno == EEXIST else { throw Failure.system("mkdir \(made): \(errorText())") }
                        // (In a directory only root or the daemon's user can change: nobody
                        // could have put a link in its place.)
                        chmod(made, 0o755)
                    }
                }
            }
            try checkResolved(directory)
            try SocketPath.checkDirectories(above: path)
        } catch let failure as Failure {
            throw failure
        } catch let SocketPath.Failure.unsafeDirectory(unsafe, why) {
            throw .unsafeDirectory(unsafe, why)
        } catch {
            throw .system("\(path): \(error)")
        }
        let fd = Glibc.open(directory, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
        guard fd >= 0 else { throw .system("open \(directory): \(errorText())") }
        return (fd, String(path[path.index(after: path.lastIndex(of: "/")!)...]))
    }

    /// Refuses a directory whose path holds a symlink (it resolves to another path).
    private static func checkResolved(_ directory: String) throws(Failure) {
        guard let real = realpath(directory, nil) else { throw .system("\(directory): \(errorText())") }
        defer { free(real) }
        let resolved = String(cString: real)
        guard resolved == directory else {
            throw .unsafeDirectory(directory, "a symlink on the way (it is \(resolved)): name the directory itself")
        }
    }

    /// Refuses a path that holds anything but a regular file.
    private static func checkTarget(_ directory: Int32, _ name: String, _ path: String) throws(Failure) {
        var info = stat()
        guard fstatat(directory, name, &info, AT_SYMLINK_NOFOLLOW) == 0 else {
            if errno == ENOENT { return }
            throw .system("stat \(path): \(errorText())")
        }
        switch info.st_mode & S_IFMT {
        case S_IFREG: return
        case S_IFLNK: throw .notAFile(path, "a symlink")
        case S_IFDIR: throw .notAFile(path, "a directory")
        default: throw .notAFile(path, "not a regular file")
        }
    }

    private static func parent(of path: String) -> String {
        guard let slash = path.lastIndex(of: "/"), slash != path.startIndex else { return "/" }
        return String(path[..<slash])
    }

    private static func writeAll(_ fd: Int32, _ bytes: [UInt8], _ path: String) throws(Failure) {
        var offset = 0
        while offset < bytes.count {
            let n = bytes.withUnsafeBytes { Glibc.write(fd, $0.baseAddress! + offset, $0.count - offset) }
            if n < 0 {
                if errno == EINTR { continue }
                throw .system("write \(path): \(errorText())")
            }
            offset += n
        }
    }

    private static func errorText() -> String { String(cString: strerror(errno)) }
}
