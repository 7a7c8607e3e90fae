import Basics

/// The verbs of `tokenbroker ctl`, declared once: what each takes, its line in `ctl --help`,
/// its own help, and the verb options it accepts. `ctl`'s parsing and usage errors, the help
/// texts, and the documentation tests (the man page, doc/operating.md) all follow this table.
public struct CtlVerb: Sendable {
    public let name: String
    /// Its operands, as the usage names them: `["session", "method", "url"]`.
    public let operands: [String]
    /// Its line in `ctl --help` (admin-only verbs say so).
    public let summary: String
    /// The verb options it takes (the global ones, `--socket` and `--json`, every verb takes).
    /// (Arrays, here and below: a few names each, and no `Set` to hash on every `ctl` call.)
    public let options: [String]
    /// `ctl <verb> --help`.
    public let help: String
    /// Where it runs: in the small static `tokenbroker`, or in `tokenbroker-daemon` (which
    /// links what it needs).
    public let execution: Execution
    /// Its last operand may be given more than once (`delegate <session>...`).
    public let variadic: Bool
    /// What it does, once its operands and options are checked.
    let handler: @Sendable (Ctl.Invocation, inout any TextOutput) throws(Ctl.Failure) -> Void

    public enum Execution: Sendable, Equatable {
        case here
        /// In `tokenbroker-daemon` (`check-config` reads the configuration with its parsers).
        case daemon
        /// In `tokenbroker-daemon` when standard output is a terminal: a login may draw a QR
        /// code with a library only a dynamically linked process loads (`QRCode`).
        case daemonOnTerminal
    }

    init(_ name: String, _ operands: [String], variadic: Bool = false, options: [String] = [], _ summary: String, help: String,
         execution: Execution = .here, _ handler: @escaping @Sendable (Ctl.Invocation, inout any TextOutput) throws(Ctl.Failure) -> Void) {
        self.name = name
        self.variadic = variadic
        self.operands = operands
        self.summary = summary
        self.options = options
        self.help = help
        self.execution = execution
        self.handler = handler
    }

    public static let all: [CtlVerb] = [
        CtlVerb("status", [], "Show the sessions this user may use.", help: Help.ctlStatus, Ctl.status),
        CtlVerb("watch", ["session"], options: ["--show-token"],
                "Print one line per token and logout event (no token unless --show-token).", help: Help.ctlWatch, Ctl.watch),
        CtlVerb("token", ["session"], options: ["--min-valid", "--resource", "--scope"], "Print the session's current access token alone, for $(…).", help: Help.ctlToken, Ctl.token),
        CtlVerb("recover", ["session"], options: ["--resource", "--scope"], "Read a rejected token on stdin; print the token to retry with.", help: Help.ctlRecover, Ctl.recover),
        CtlVerb("proof", ["session", "method", "url"], options: ["--nonce", "--min-valid", "--resource", "--scope"],
                "Print the two headers of one DPoP request (Authorization, DPoP).", help: Help.ctlProof, Ctl.proof),
        CtlVerb("login", ["session"], options: ["--flow", "--refresh-token-stdin"],
                "Log the session in: device or code flow, or --refresh-token-stdin (admin).", help: Help.ctlLogin, execution: .daemonOnTerminal, Ctl.login),
        CtlVerb("logout", ["session"], "Log the session out (admin).", help: Help.ctlLogout, Ctl.logout),
        CtlVerb("forget", ["session"], "Remove a stored session the configuration no longer names (admin).", help: Help.ctlForget, Ctl.forget),
        CtlVerb("refresh", ["session"], "Refresh the session's token now (admin).", help: Help.ctlRefresh, Ctl.refresh),
        CtlVerb("reset-fleet-history", ["session"], "Start a fleet session's history anew, past its limit (admin).",
                help: Help.ctlResetFleetHistory, Ctl.resetFleetHistory),
        CtlVerb("reload", [], "Make the daemon re-read its configuration (admin).", help: Help.ctlReload, Ctl.reload),
        CtlVerb("delegate", ["session"], variadic: true, options: delegateOptions,
                "Serve sessions on a socket of their own, or a token file, for a container or host (admin).", help: Help.ctlDelegate, Ctl.delegate),
        CtlVerb("delegations", [], "List the delegations, their sockets and token files (admin).", help: Help.ctlDelegations, Ctl.delegations),
        CtlVerb("undelegate", ["name"], "End a delegation: its socket and connections close, its file is erased (admin).", help: Help.ctlUndelegate, Ctl.undelegate),
        CtlVerb("audit", [], options: ["--session", "--limit"], "Show who was handed which token lately (admin).", help: Help.ctlAudit, Ctl.audit),
        CtlVerb("client-key", ["session"], options: ["--rotate", "--promote", "--retire", "--jwk"],
                "Print the JWKS of a private_key_jwt session's client keys to register; rotate them (admin).", help: Help.ctlClientKey, Ctl.clientKey),
        CtlVerb("metrics", [], "Print the daemon's metrics, Prometheus text format (admin).", help: Help.ctlMetrics, Ctl.metrics),
        // (Never reaches its handler: `Ctl.run` hands it to the daemon's executable, options and all.)
        CtlVerb("check-config", [], "Validate the configuration files (same as `tokenbroker check-config`).", help: Help.checkConfig,
                execution: .daemon) { _, _ throws(Ctl.Failure) in throw Ctl.Failure(code: ExitCode.failure, message: "check-config runs in tokenbroker-daemon") },
    ]

    /// The verb `ctl`'s arguments name (its first word that is neither an option nor an
    /// option's value), for deciding where it runs before it is parsed.
    static func verb(of arguments: some Collection<String>) -> CtlVerb? {
        var skipNext = false
        for argument in arguments {
            if skipNext { skipNext = false; continue }
            if ["--socket", "--nonce", "--min-valid", "--flow", "--resource", "--scope"].contains(argument) || valueOptions.contains(argument) {
                skipNext = true
                continue
            }
            if argument.hasPrefix("-") { continue }
            return named(argument)
        }
        return nil
    }

    public static func named(_ name: String) -> CtlVerb? { all.first { $0.name == name } }

    /// Where the verb `name` runs (nil: no such verb). (No `CtlVerb?` made: destroying one
    /// instantiates its optional's metadata, a cost on every `ctl` call.)
    static func execution(of name: String) -> Execution? {
        for verb in all where verb.name == name { return verb.execution }
        return nil
    }

    /// The verb a mistyped one probably meant.
    static func suggestion(for name: String) -> String? { Spelling.closest(to: name, in: all.lazy.map(\.name)) }

    /// The verbs that take `option`, for "--nonce belongs to proof".
    static func takers(of option: String) -> [String] { all.filter { $0.options.contains(option) }.map(\.name) }

    /// The options with a value only `delegate` takes (its `--socket` is the global one's name,
    /// read after the verb).
    static let delegateOptions = ["--ttl", "--name", "--mode", "--owner", "--group", "--allow-users", "--allow-groups",
                                                "--max-connections", "--file", "--format", "--readers", "--file-mode"]

    /// The options with a value that `delegate` and `audit` take, read into `Invocation.values`.
    static let valueOptions = delegateOptions + ["--session", "--limit"]

    /// `proof <session> <method> <url>`.
    var synopsis: String { ([name] + operands.map { "<\($0)>" }).joined(separator: " ") + (variadic ? "..." : "") }

    /// What a wrong number of operands is told.
    var operandRule: String {
        switch operands.count {
        case 0: return "\(name) takes no operand"
        case 1 where variadic: return "\(name) needs one \(operands[0].uppercased()) or more"
        case 1: return "\(name) needs exactly one \(operands[0].uppercased())"
        default:
            let named = operands.map { "a \($0.uppercased())" }
            return "\(name) needs \(named.dropLast().joined(separator: ", ")) and \(named.last!)"
        }
    }

    /// The USAGE lines of its help, for a usage error.
    var usage: String {
        var lines: [Substring] = []
        for line in help.split(separator: "\n", omittingEmptySubsequences: false) {
            if line.hasPrefix("USAGE:") || (!lines.isEmpty && line.hasPrefix("       ")) {
                lines.append(line)
            } else if !lines.isEmpty {
                break
            }
        }
        return lines.joined(separator: "\n") + "\n\nSee `tokenbroker help ctl \(name)`.\n"
    }

    /// What a usage error without a known verb shows: the usage and the verbs.
    static var shortUsage: String {
        "USAGE: tokenbroker ctl [--socket <path>] [--json] <verb> [<session>] [<verb options>]\n\n"
            + "Verbs: " + all.map(\.name).joined(separator: ", ") + ".\nSee `tokenbroker help ctl`, or `tokenbroker help ctl <verb>`.\n"
    }

    /// The SUBCOMMANDS section of `ctl --help`.
    static var listing: String {
        all.map { verb in
            let left = "  " + verb.synopsis
            return left.count + 2 <= 26
                ? left + String(repeating: " ", count: 26 - left.count) + verb.summary + "\n"
                : left + "\n" + String(repeating: " ", count: 26) + verb.summary + "\n"
        }.joined()
    }
}
