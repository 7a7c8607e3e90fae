#if canImport(Glibc)
import Glibc
#endif

/// Paths given on the command line: a relative one means relative to the working directory, as
/// in every other command, and is made absolute at once (the daemon checks and logs absolute
/// paths; a later change of directory must not change what they name).
public enum CommandLinePath {
    /// `path` made absolute against the working directory; nil for an empty path or when the
    /// working directory cannot be read.
    public static func absolute(_ path: String) -> String? {
        guard !path.isEmpty else { return nil }
        if path.hasPrefix("/") { return path }
        // (`./x` is `x`: the path the daemon logs and the guide prints reads plainly.)
        var path = Substring(path)
        while path.hasPrefix("./") { path = path.dropFirst(2).drop { $0 == "/" } }
        guard !path.isEmpty else { return nil }
        guard let directory = getcwd(nil, 0) else { return nil }
        defer { free(directory) }
        let base = String(cString: directory)
        return (base.hasSuffix("/") ? base : base + "/") + String(path)
    }
}
