#if canImport(Glibc)
import Glibc
#endif
import Varlink

/// Binding the daemon's socket file: the parent directory is created when missing, a stale
/// socket is replaced only when nothing answers on it, and the file gets its mode and group.
///
/// The daemon often runs as root, so nothing here may follow a name someone else controls. The
/// socket's directory is resolved (symlinks followed once, by `realpath`), and then it and
/// every directory above it must be owned by root or the daemon's user; the socket's own
/// directory writable by nobody else, those above it only if sticky (like /tmp, where nobody
/// can replace another's entry). The socket is bound at the resolved path, its mode set at
/// creation (umask), its group with `lchown`, which never follows a symlink.
enum SocketPath {
    enum Failure: Error, CustomStringConvertible {
        case inUse(String)
        case notASocket(String)
        case unsafeDirectory(String, String)
        case system(SocketError)

        var description: String {
            switch self {
            case let .inUse(path): return "\(path): another instance is listening on it"
            case let .notASocket(path): return "\(path): exists and is not a socket; not replacing it"
            case let .unsafeDirectory(directory, why):
                return "\(directory): \(why); the socket must live in a directory only root or this daemon's user can change"
            case let .system(error): return error.description
            }
        }
    }

    /// Binds and listens on `path`; returns the descriptor and the socket file's identity.
    static func bind(_ configured: String, mode: UInt32, group: UInt32?, owner: UInt32? = nil) throws(Failure) -> (fd: Int32, inode: ino_t) {
        try makeParent(of: configured)
        let path = try resolved(configured)
        try checkDirectories(above: path)
        var info = stat()
        if lstat(path, &info) == 0 {
            guard info.st_mode & S_IFMT == S_IFSOCK else { throw .notASocket(path) }
            if UnixSocket.isListening(path) { throw .inUse(path) }
            unlink(path)   // stale: nobody answers
        }
        // Create the file with no access beyond `mode` from the start (no window with a
        // wider mode between bind and chmod).
        let previous = umask(mode_t(~mode & 0o777))
        let fd: Int32
        do {
            fd = try UnixSocket.listen(path: path)
        } catch {
            umask(previous)
            throw .system(error)
        }
        umask(previous)
        if group != nil || owner != nil, lchown(path, owner.map { uid_t($0) } ?? uid_t.max, group.map { gid_t($0) } ?? gid_t.max) != 0 {
            let error = SocketError("chown \(path) to \(owner.map { "user \($0)" } ?? "")\(owner != nil && group != nil ? ", " : "")"
                                    + "\(group.map { "group \($0)" } ?? "")")
            close(fd)
            unlink(path)
            throw .system(error)
        }
        lstat(path, &info)
        return (fd, info.st_ino)
    }

    /// `path` with its directory resolved to a path without symlinks.
    static func resolved(_ path: String) throws(Failure) -> String {
        guard let slash = path.lastIndex(of: "/") else { return path }
        let directory = slash == path.startIndex ? "/" : String(path[..<slash])
        guard let real = realpath(directory, nil) else { throw .system(SocketError("realpath \(directory)")) }
        defer { free(real) }
        let base = String(cString: real)
        return (base == "/" ? "" : base) + String(path[slash...])
    }

    /// Refuses a socket path below a directory that someone other than root or this process's
    /// user could change (replace the socket with a link between bind and chown, say, or take
    /// its name first). `path`'s directories must hold no symlink (see `resolved`).
    static func checkDirectories(above path: String) throws(Failure) {
        var directory = path
        let me = getuid()
        var immediate = true
        while let slash = directory.lastIndex(of: "/") {
            directory = slash == directory.startIndex ? "/" : String(directory[..<slash])
            var info = stat()
            guard lstat(directory, &info) == 0 else { throw .system(SocketError("lstat \(directory)")) }
            guard info.st_mode & S_IFMT == S_IFDIR else { throw .unsafeDirectory(directory, "not a directory (a symlink?)") }
            if info.st_uid != 0 && info.st_uid != me { throw .unsafeDirectory(directory, "owned by uid \(info.st_uid)") }
            let sticky = info.st_mode & S_ISVTX != 0
            if info.st_mode & (S_IWGRP | S_IWOTH) != 0 && (immediate || !sticky) {
                throw .unsafeDirectory(directory, "writable by \(info.st_mode & S_IWOTH != 0 ? "everyone" : "group \(info.st_gid)")")
            }
            immediate = false
            if directory == "/" { return }
        }
    }

    /// Removes the socket file if it is still the one this process bound.
    static func remove(_ path: String, inode: ino_t) {
        var info = stat()
        if lstat(path, &info) == 0, info.st_ino == inode, info.st_mode & S_IFMT == S_IFSOCK { unlink(path) }
    }

    private static func makeParent(of path: String) throws(Failure) {
        guard let slash = path.lastIndex(of: "/"), slash != path.startIndex else { return }
        let parent = String(path[..<slash])
        var info = stat()
        if stat(parent, &info) == 0 { return }
        try makeParent(of: parent)
        guard mkdir(parent, 0o755) == 0 else {
            if errno == EEXIST { return }
            throw .system(SocketError("mkdir \(parent)"))
        }
        // (Whatever the daemon's umask, 0077 under the shipped unit: its peers must reach the
        // socket. Only the directory made here, never what a link might have put there.)
        let made = open(parent, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
        if made >= 0 {
            fchmod(made, 0o755)
            close(made)
        }
    }
}
