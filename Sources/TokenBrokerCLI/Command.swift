#if canImport(Glibc)
import Glibc
#endif
import Basics
import BrokerContract
import Varlink

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
    public static let helperNames: [String: String] = Dictionary(uniqueKeysWithValues: CredentialProtocol.all.compactMap { entry in
        entry.link.map { ($0, entry.name) }
    })

    /// The arguments to run, given the name the process was started by (`argv[0]`).
    public static func arguments(invokedAs name: String, _ arguments: [String]) -> [String] {
        // (Every link's name ends so, which a test checks: `tokenbroker` itself never builds the table.)
        guard name.hasSuffix(helperSuffix) else { return arguments }
        let base = name.split(separator: "/").last.map(String.init) ?? name
        guard let protocolName = helperNames[base] else { return arguments }
        return ["credential", protocolName] + arguments
    }

    /// How the name of every credential helper's link ends.
    static let helperSuffix = "-tokenbroker"

    /// The arguments of this process (`argv` after the name it was started by, `argv[0]`), read
    /// without `CommandLine.arguments`, whose first use costs the static `tokenbroker` about a
    /// tenth of a `ctl token`.
    public static func processArguments() -> [String] {
        let count = Int(CommandLine.argc)
        var arguments: [String] = []
        arguments.reserveCapacity(max(count - 1, 0))
        for index in 1..<max(count, 1) { arguments.append(CommandLine.unsafeArgv[index].map { String(cString: $0) } ?? "") }
        return self.arguments(invokedAs: count > 0 ? CommandLine.unsafeArgv[0].map { String(cString: $0) } ?? "" : "", arguments)
    }

    /// Whether the static `tokenbroker` should try `tokenbroker-daemon` first for `arguments`,
    /// running them itself if that cannot start: a ctl verb that runs there on a terminal
    /// (`terminal`: standard output is one). (`.daemon` verbs come back from `run` instead.)
    public static func prefersDaemon(_ arguments: [String], terminal: Bool) -> Bool {
        guard terminal, arguments.first == "ctl", let verb = CtlVerb.verb(of: arguments.dropFirst()) else { return false }
        return verb.execution == .daemonOnTerminal
    }

    /// The subcommands only `tokenbroker-daemon` runs.
    public static let daemonSubcommands = ["serve", "check-config"]

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

    /// `tokenbroker version`: this command's version, and the running broker's (its varlink
    /// service info), which may differ after an upgrade until the daemon restarts.
    static func versions(_ rest: [String], output: inout some TextOutput, errors: inout some TextOutput) -> Int32 {
        if rest.contains("-h") || rest.contains("--help") {
            output.write(Help.version)
            return ExitCode.ok
        }
        // Nothing, or the socket alone.
        var socket = BrokerContract.socket()
        if rest.count == 2 && rest[0] == "--socket" {
            socket = rest[1]
        } else if rest.count == 1 && rest[0].hasPrefix("--socket=") {
            socket = String(rest[0].dropFirst("--socket=".count))
        } else if !rest.isEmpty {
            errors.write("Error: unknown option or operand '\(rest[0].prefix(64))'\n\n" + Help.version)
            return ExitCode.usage
        }
        output.write("tokenbroker \(version)\n")
        guard let address = Ctl.address(socket) else {
            errors.write("Error: invalid socket address '\(socket)' (a path, @abstract or unix:path)\n")
            return ExitCode.usage
        }
        do {
            let reply = try VarlinkClient(address: address, timeout: 10).call("org.varlink.service.GetInfo")
            guard reply.error == nil, let running = reply.parameters["version"]?.stringValue else {
                output.write("broker at \(address.path): did not say its version (\(reply.error ?? "no version"))\n")
                return ExitCode.ok
            }
            let note = running == version ? "" : " (not this command's: restart it to run \(version))"
            output.write("broker \(running.prefix(64)) at \(address.path)\(note)\n")
        } catch {
            output.write("broker at \(address.path): not reachable (\(Ctl.unreachable(address, error).message))\n")
        }
        return ExitCode.ok
    }

    /// " (did you mean serve?)", or a ctl verb given without `ctl`.
    static func suggestion(for word: String) -> String {
        if CtlVerb.named(word) != nil { return " (did you mean `tokenbroker ctl \(word)`?)" }
        let subcommands = ["serve", "ctl", "check-config", "credential", "help", "version"]
        if let close = Spelling.closest(to: word, in: subcommands) { return " (did you mean \(close)?)" }
        if let verb = CtlVerb.suggestion(for: word) { return " (did you mean `tokenbroker ctl \(verb)`?)" }
        return ""
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
        case "--version", "-V":
            output.write("tokenbroker \(version)\n")
            return ExitCode.ok
        case "version":
            return versions(rest, output: &output, errors: &errors)
        default:
            errors.write("Error: unknown subcommand or option '\(first.prefix(64))'\(suggestion(for: first))\n\n" + Help.main)
            return ExitCode.usage
        }
    }
}
