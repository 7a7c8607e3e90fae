#if canImport(Glibc)
import Glibc
#endif
import Basics

/// `tokenbroker-daemon`, found beside the running executable: in the same directory (a build
/// tree) or in `../libexec/tokenbroker/` (an installation: /usr/bin → /usr/libexec).
public enum DaemonExecutable {
    public static let name = "tokenbroker-daemon"

    /// The package's and `make install`'s places, when the running executable's directory
    /// cannot be read (no /proc) or holds no daemon (a LIBEXECDIR elsewhere).
    static let installed = ["/usr/libexec/tokenbroker/", "/usr/local/libexec/tokenbroker/"]

    /// Where the daemon executable is, or nil.
    public static func path() -> String? {
        var candidates: [String] = []
        if let executable = realpath("/proc/self/exe", nil) {
            var directory = String(cString: executable)
            free(executable)
            if let slash = directory.lastIndex(of: "/") { directory = String(directory[..<slash]) }
            candidates += [directory + "/" + name, directory + "/../libexec/tokenbroker/" + name]
        }
        candidates += installed.map { $0 + name }
        return candidates.first { access($0, X_OK) == 0 }
    }

    /// Replaces this process with the daemon executable running `subcommand`; returns (an exit
    /// code, with the reason on standard error) only if that fails.
    ///
    /// For `serve`, SIGTERM, SIGINT and SIGHUP are blocked first: the mask and any signal
    /// pending survive exec, and the daemon reads them once it can (a `systemctl reload` or stop
    /// right after start is neither fatal nor lost).
    public static func exec(_ subcommand: String, _ arguments: [String], errors: inout some TextOutput) -> Int32 {
        if subcommand == "serve" {
            var set = sigset_t()
            sigemptyset(&set)
            for number in [SIGTERM, SIGINT, SIGHUP] { sigaddset(&set, number) }
            pthread_sigmask(SIG_BLOCK, &set, nil)
        }
        guard let path = path() else {
            errors.write("Error: cannot find \(name) beside this executable, in ../libexec/tokenbroker/ or in \(installed.joined(separator: " or "))\n")
            return ExitCode.failure
        }
        let argv = [path, subcommand] + arguments
        var pointers = argv.map { strdup($0) }
        pointers.append(nil)
        execv(path, pointers)
        let reason = String(cString: strerror(errno))
        errors.write("Error: cannot run \(path): \(reason)\n")
        return ExitCode.failure
    }
}
