#if canImport(Glibc)
import Glibc
#endif

/// Parses argv and runs a verb. Until the daemon lands, only help and version exist.
enum CommandLineTool {
    static let version = "0.1.0"

    /// Exit codes (sysexits): 0 ok, 1 failure, 64 usage, 78 configuration.
    enum ExitCode {
        static let ok: Int32 = 0
        static let failure: Int32 = 1
        static let usage: Int32 = 64
        static let config: Int32 = 78
    }

    static let help = """
        OVERVIEW: tokenbroker — one OAuth 2.0 refresh flight per session, shared by every local worker

        A long-running daemon owns the OAuth sessions of this machine and hands out current
        access tokens over a varlink Unix socket. All workers share one refresh flight and one
        logout boundary per session, so parallel 401s never rotate a refresh token twice and a
        logout is never undone by a late refresh.

        USAGE: tokenbroker <subcommand> [options]

        OPTIONS:
          -h, --help              Show this help.
          --version               Show the version.

        SUBCOMMANDS:
          help [<subcommand>]     Show this help.

        The daemon (`serve`) and the control verbs (`ctl …`) are not built yet.

        """

    static func run(_ arguments: [String]) -> Int32 {
        guard let first = arguments.first else {
            printErr("Error: missing subcommand\n\n" + help)
            return ExitCode.usage
        }
        switch first {
        case "-h", "--help", "help":
            print(help, terminator: "")
            return ExitCode.ok
        case "--version":
            print("tokenbroker \(version)")
            return ExitCode.ok
        default:
            printErr("Error: unknown subcommand or option '\(first)'\n\n" + help)
            return ExitCode.usage
        }
    }

    static func printErr(_ text: String) {
        var text = text
        text.withUTF8 { bytes in
            var offset = 0
            while offset < bytes.count {
                let n = write(2, bytes.baseAddress! + offset, bytes.count - offset)
                if n <= 0 { break }
                offset += n
            }
        }
    }
}
