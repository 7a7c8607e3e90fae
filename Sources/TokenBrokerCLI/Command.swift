#if canImport(Glibc)
import Glibc
#endif
import Basics

/// The `tokenbroker` command line: argv in, exit code out.
///
/// Two executables share it. `tokenbroker` is small and fully static: help, `--version` and
/// every `ctl` verb run in it, so a script's `$(tokenbroker ctl token s)` costs little more than
/// starting `/bin/true`. `serve` and `check-config` need libcurl, SQLite, libcrypto and
/// libsystemd: `tokenbroker` replaces itself (exec, same pid) with `tokenbroker-daemon`, which
/// runs them.
public enum Command {
    public static let version = Product.version

    /// The names tools run a credential helper by (links to `tokenbroker` the package
    /// installs), and the protocol each speaks: `docker-credential-tokenbroker get` is
    /// `tokenbroker credential docker get`.
    public static let helperNames = ["git-credential-tokenbroker": "git", "docker-credential-tokenbroker": "docker",
                                     "terraform-credentials-tokenbroker": "terraform", "bazel-credential-tokenbroker": "bazel"]

    /// The arguments to run, given the name the process was started by (`argv[0]`).
    public static func arguments(invokedAs name: String, _ arguments: [String]) -> [String] {
        let base = name.split(separator: "/").last.map(String.init) ?? name
        guard let protocolName = helperNames[base] else { return arguments }
        return ["credential", protocolName] + arguments
    }

    /// The subcommands only `tokenbroker-daemon` runs.
    public static let daemonSubcommands: Set<String> = ["serve", "check-config"]

    public enum Outcome: Equatable {
        /// Done, with this exit code.
        case exit(Int32)
        /// A daemon subcommand, with its arguments, for the caller to run.
        case daemon(String, [String])
    }

    /// Runs `arguments`, but for the daemon subcommands, which it hands back.
    public static func run(_ arguments: [String], output: inout some TextOutput, errors: inout some TextOutput) -> Outcome {
        guard let first = arguments.first else {
            errors.write("Error: missing subcommand\n\n" + Help.main)
            return .exit(ExitCode.usage)
        }
        if daemonSubcommands.contains(first) { return .daemon(first, Array(arguments.dropFirst())) }
        if first == "ctl" { return Ctl.run(Array(arguments.dropFirst()), output: &output, errors: &errors) }
        if first == "credential" { return .exit(CredentialHelper.run(Array(arguments.dropFirst()), output: &output, errors: &errors)) }
        return .exit(runHere(first, Array(arguments.dropFirst()), output: &output, errors: &errors))
    }

    private static func runHere(_ first: String, _ rest: [String], output: inout some TextOutput, errors: inout some TextOutput) -> Int32 {
        switch first {
        case "-h", "--help":
            output.write(Help.main)
            return ExitCode.ok
        case "help":
            guard !rest.isEmpty else {
                output.write(Help.main)
                return ExitCode.ok
            }
            guard let text = Help.topic(rest) else {
                errors.write("Error: no help for '\(rest.joined(separator: " "))'\n\n" + Help.main)
                return ExitCode.usage
            }
            output.write(text)
            return ExitCode.ok
        case "--version":
            output.write("tokenbroker \(version)\n")
            return ExitCode.ok
        default:
            errors.write("Error: unknown subcommand or option '\(first)'\n\n" + Help.main)
            return ExitCode.usage
        }
    }
}
