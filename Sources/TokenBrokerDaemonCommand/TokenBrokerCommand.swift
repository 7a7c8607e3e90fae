import Dispatch
import Synchronization
import Basics
import BrokerContract
import TokenBrokerCLI
import TokenBrokerDaemon
import Fleet

/// The `tokenbroker` command line: parses argv, runs a subcommand, returns the exit code.
public enum TokenBrokerCommand {
    /// The process's entry point, called from the main thread before any other thread exists.
    ///
    /// `serve` blocks the signals it handles first (see `Signals`), then runs the daemon on the
    /// cooperative pool while the main thread waits — with those signals still blocked. (An
    /// async `main` would park the main thread in libdispatch's `sigsuspend` with an empty mask,
    /// where a SIGTERM that arrives before the daemon's signal sources are registered takes the
    /// default action.) Every other subcommand runs synchronously on the main thread.
    public static func main(_ arguments: [String], development: (@Sendable () throws -> any DevelopmentEnvironment)? = nil) -> Int32 {
        var output = FileOutput.standardOutput
        var errors = FileOutput.standardError
        guard arguments.first == "serve" else { return run(arguments, output: &output, errors: &errors) }
        Signals.block()
        switch parseServe(Array(arguments.dropFirst()), output: &output, errors: &errors) {
        case let .exit(code):
            return code
        case var .run(options):
            options.makeDevelopment = development
            Daemon.limitMallocArenas()
            let code = Mutex<Int32>(ExitCode.failure)
            let done = DispatchSemaphore(value: 0)
            // Default priority: a task made on the main thread would otherwise inherit its
            // user-interactive class, whose worker threads ask for nice -4.
            Task(priority: .medium) {
                let result = await Daemon.run(options)
                code.withLock { $0 = result }
                done.signal()
            }
            done.wait()
            return code.withLock { $0 }
        }
    }

    /// Everything but running the daemon; testable with string outputs.
    public static func run(_ arguments: [String], output: inout some TextOutput, errors: inout some TextOutput) -> Int32 {
        switch Command.run(arguments, output: &output, errors: &errors) {
        case let .exit(code):
            return code
        case let .daemon("check-config", rest):
            return checkConfig(rest, output: &output, errors: &errors)
        case let .daemon(_, rest):
            if case let .exit(code) = parseServe(rest, output: &output, errors: &errors) { return code }
            errors.write("Error: serve runs only from the binary\n")
            return ExitCode.usage
        }
    }

    enum ServeParse {
        case run(Daemon.Options)
        case exit(Int32)
    }

    static func parseServe(_ arguments: [String], output: inout some TextOutput, errors: inout some TextOutput) -> ServeParse {
        var options = Daemon.Options()
        var index = 0
        func value(_ name: String) -> String? {
            guard index + 1 < arguments.count else { return nil }
            index += 1
            return arguments[index]
        }
        while index < arguments.count {
            var argument = arguments[index]
            var inline: String?
            if argument.hasPrefix("--"), let equals = argument.firstIndex(of: "=") {
                inline = String(argument[argument.index(after: equals)...])
                argument = String(argument[..<equals])
            }
            func absolutePath(_ name: String) -> String? {
                guard let path = inline ?? value(name) else { return nil }
                return CommandLinePath.absolute(path)
            }
            switch argument {
            case "-h", "--help":
                output.write(Help.serve)
                return .exit(ExitCode.ok)
            case "--config":
                guard let path = inline ?? value(argument) else { return usageError("--config needs a path", Help.serve, &errors) }
                options.configPath = path
                options.configPathGiven = true
            case "--socket":
                guard let path = absolutePath(argument) else { return usageError("--socket needs a path", Help.serve, &errors) }
                options.socketPath = path
            case "--dev":
                options.dev = true
            case "--user":
                options.user = true
            case "--state-dir":
                guard let path = absolutePath(argument) else { return usageError("--state-dir needs a path", Help.serve, &errors) }
                options.stateDirectory = path
            case "--log-level":
                guard let name = inline ?? value(argument), let level = LogLevel(name: name) else {
                    return usageError("--log-level needs one of emerg, alert, crit, err, warning, notice, info, debug", Help.serve, &errors)
                }
                options.logLevel = level
            default:
                return usageError("unknown option '\(arguments[index])'", Help.serve, &errors)
            }
            index += 1
        }
        if options.user {
            // This user's own broker: its XDG directories, for what was not given.
            let directories = UserDirectories()
            if !options.configPathGiven { options.configPath = directories.config + "/tokenbroker/tokenbroker.conf" }
            if options.socketPath == nil { options.socketPath = BrokerContract.userSocket(directories) }
        }
        return .run(options)
    }

    private static func usageError(_ message: String, _ help: String, _ errors: inout some TextOutput) -> ServeParse {
        errors.write("Error: \(message)\n\n" + help)
        return .exit(ExitCode.usage)
    }

    /// How many sessions, and the first few by name (every one, a line each, with `verbose`):
    /// a host with thousands of sessions gets one short line.
    static func sessionList(_ names: [String], verbose: Bool) -> String {
        let count = "\(names.count) session(s)"
        if names.isEmpty { return count + "\n" }
        if verbose { return count + ":\n" + names.map { "  \($0)\n" }.joined() }
        let shown = 5
        guard names.count > shown else { return count + ": " + names.joined(separator: ", ") + "\n" }
        return count + ": " + names.prefix(shown).joined(separator: ", ") + ", … (--verbose lists all)\n"
    }

    /// Every configuration key, from `ConfigSchema`: what it takes, its default, what a change
    /// does at a reload, and one line on what it is for.
    static func keyReference() -> String {
        var text = ""
        for (section, keys) in ConfigSchema.reference {
            text += "[\(section)]\n"
            for key in keys {
                let defaultValue = key.defaultValue.isEmpty ? "" : "; default \(key.defaultValue)"
                text += "  \(key.name)=  \(key.takes)\(defaultValue); \(key.change)\n      \(key.summary)\n"
            }
        }
        return text
    }

    static func checkConfig(_ arguments: [String], output: inout some TextOutput, errors: inout some TextOutput) -> Int32 {
        var path = BrokerConfiguration.defaultPath
        var verbose = false
        var index = 0
        while index < arguments.count {
            switch arguments[index] {
            case "-h", "--help":
                output.write(Help.checkConfig)
                return ExitCode.ok
            case "-v", "--verbose":
                verbose = true
            case "--keys":
                output.write(keyReference())
                return ExitCode.ok
            case "--config":
                guard index + 1 < arguments.count else {
                    errors.write("Error: --config needs a path\n\n" + Help.checkConfig)
                    return ExitCode.usage
                }
                path = arguments[index + 1]
                index += 1
            default:
                if arguments[index].hasPrefix("--config=") {
                    path = String(arguments[index].dropFirst("--config=".count))
                } else {
                    errors.write("Error: unknown option '\(arguments[index])'\n\n" + Help.checkConfig)
                    return ExitCode.usage
                }
            }
            index += 1
        }
        do {
            let configuration = try ConfigLoader.load(path: path)
            for warning in configuration.warnings { errors.write("warning: \(warning.location)\n") }
            guard !configuration.sessions.isEmpty else {
                // Valid, but a broker that serves nothing: say so, and how to add one.
                output.write("\(path): OK, but it defines no session: every call would be told NoSuchSession; "
                             + "add a [Session] (a drop-in in \(path).d/; one to copy: /usr/share/doc/tokenbroker/examples/example.conf)\n")
                return ExitCode.ok
            }
            output.write("\(path): OK, \(sessionList(configuration.sessions.map(\.name), verbose: verbose))")
            if let fleet = configuration.fleet {
                let shared = configuration.sessions.filter { $0.fleet != nil }.map(\.name)
                output.write("fleet: member \(fleet.member), prefix \(fleet.prefix), \(fleet.endpoints.count) etcd endpoint(s), flight lease "
                             + "\(fleet.flightLease.components.seconds)s; shared: \(shared.isEmpty ? "no sessions\n" : sessionList(shared, verbose: verbose))")
            }
            if !configuration.delegations.isEmpty || !configuration.outputs.isEmpty {
                let delegations = configuration.delegations.map { "\($0.name) (\($0.sessions.joined(separator: " ")) on \($0.socket))" }
                let files = configuration.outputs.map { "\($0.name) (\($0.session) in \($0.path))" }
                output.write("delegations: \(delegations.joined(separator: ", ").nonEmpty ?? "none"); "
                             + "token files: \(files.joined(separator: ", ").nonEmpty ?? "none")\n")
            }
            return ExitCode.ok
        } catch {
            // Every error and warning, in file order: a warning's "did you mean" may be the
            // cause of the error after it.
            let all = ([error] + error.further).map { ("Error", $0) } + error.warnings.map { ("warning", $0) }
            for (label, one) in ConfigError.inFileOrder(all, main: path, \.1) { errors.write("\(label): \(one.location)\n") }
            let count = 1 + error.further.count + error.omitted
            if error.omitted > 0 { errors.write("(and \(error.omitted) more errors)\n") }
            if count > 1 || !error.warnings.isEmpty {
                errors.write("\(path): \(count) error(s), \(error.warnings.count) warning(s)\n")
            }
            return ExitCode.config
        }
    }
}

private extension String {
    /// Itself, or nil when empty.
    var nonEmpty: String? { isEmpty ? nil : self }
}
