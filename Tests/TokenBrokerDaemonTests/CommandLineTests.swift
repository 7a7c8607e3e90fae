import Foundation
import Testing
@testable import TokenBrokerCLI
import Varlink
@testable import TokenBrokerDaemon
@testable import TokenBrokerDaemonCommand

/// The command line in memory: help texts, usage errors and exit codes.
@Suite("Command line")
struct CommandLineTests {
    static func run(_ arguments: String...) -> (code: Int32, out: String, err: String) {
        var out = ""
        var err = ""
        let code = TokenBrokerCommand.run(arguments, output: &out, errors: &err)
        return (code, out, err)
    }

    @Test("-h, --help and help print the same text with every section")
    func help() {
        let texts = [Self.run("-h"), Self.run("--help"), Self.run("help")]
        #expect(texts.allSatisfy { $0.code == 0 && $0.out == Help.main && $0.err.isEmpty })
        for section in ["OVERVIEW:", "USAGE:", "OPTIONS:", "SUBCOMMANDS:"] { #expect(Help.main.contains(section)) }
    }

    @Test("help <subcommand> equals <subcommand> --help", arguments: [
        (["serve"], Help.serve), (["check-config"], Help.checkConfig), (["ctl"], Help.ctl),
        (["ctl", "status"], Help.ctlStatus), (["ctl", "token"], Help.ctlToken), (["ctl", "logout"], Help.ctlLogout),
        (["ctl", "login"], Help.ctlLogin), (["ctl", "recover"], Help.ctlRecover), (["ctl", "proof"], Help.ctlProof), (["ctl", "forget"], Help.ctlForget),
        (["ctl", "watch"], Help.ctlWatch), (["ctl", "refresh"], Help.ctlRefresh), (["ctl", "reload"], Help.ctlReload),
        (["ctl", "reset-fleet-history"], Help.ctlResetFleetHistory),
    ])
    func subcommandHelp(words: [String], text: String) {
        var out = ""
        var err = ""
        #expect(TokenBrokerCommand.run(["help"] + words, output: &out, errors: &err) == 0 && out == text)
        var direct = ""
        #expect(TokenBrokerCommand.run(words + ["--help"], output: &direct, errors: &err) == 0 && direct == text)
        for required in ["OVERVIEW:", "USAGE:", "OPTIONS:"] { #expect(text.contains(required)) }
        if words != ["ctl"] && words.count > 1 || words == ["serve"] || words == ["check-config"] { #expect(text.contains("EXAMPLE")) }
    }

    @Test("usage errors: Error: line plus usage on stderr, exit 64", arguments: [
        ["frobnicate"], ["help", "nope"], ["serve", "--bogus"], ["serve", "--socket", ""], ["serve", "--log-level", "loud"],
        ["ctl"], ["ctl", "token"], ["ctl", "reset-fleet-history"], ["ctl", "fly", "x"], ["ctl", "--what"], ["ctl", "status", "extra"], ["check-config", "--x"], [],
    ])
    func usage(arguments: [String]) {
        var out = ""
        var err = ""
        #expect(TokenBrokerCommand.run(arguments, output: &out, errors: &err) == 64)
        #expect(err.hasPrefix("Error: ") && err.contains("USAGE:") && out.isEmpty)
    }

    @Test("--version, -V; version names this command's and says when no broker answers (issue 33)")
    func version() {
        #expect(Self.run("--version") == (0, "tokenbroker \(Command.version)\n", ""))
        #expect(Self.run("-V") == (0, "tokenbroker \(Command.version)\n", ""))
        let both = Self.run("version", "--socket", "/nonexistent/tb.sock")
        #expect(both.code == 0 && both.err.isEmpty)
        #expect(both.out == "tokenbroker \(Command.version)\nbroker at /nonexistent/tb.sock: not reachable (no broker socket at /nonexistent/tb.sock; "
                + "--socket or TOKENBROKER_SOCKET names another broker)\n")
        #expect(Self.run("version", "--help") == (0, Help.version, ""))
        #expect(Self.run("help", "version") == (0, Help.version, ""))
    }

    @Test("a usage error shows the verb's usage, not all of ctl's help; did you mean for verbs and subcommands (issue 33)", arguments: [
        (["ctl", "token"], "Error: token needs exactly one SESSION\n\nUSAGE: tokenbroker ctl [--socket <path>] token <session> [--min-valid <duration>]\n"
            + "                           [--resource <url>] [--scope <words>] [--json]\n\n"
            + "See `tokenbroker help ctl token`.\n"),
        (["ctl", "status", "extra"], "Error: status takes no operand\n\nUSAGE: tokenbroker ctl [--socket <path>] status [--json]\n\nSee `tokenbroker help ctl status`.\n"),
        (["ctl", "proof", "api", "GET"], "Error: proof needs a SESSION, a METHOD and a URL\n\nUSAGE: tokenbroker ctl [--socket <path>] proof <session> <method> <url> "
            + "[--nonce <nonce>] [--min-valid <duration>]\n                           [--resource <url>] [--scope <words>] [--json]\n\n"
            + "See `tokenbroker help ctl proof`.\n"),
        (["ctl", "proof", "api", "get", "https://api.example.com/"], "Error: METHOD is upper-case letters, such as GET or POST\n\n"),
        (["ctl", "proof", "api", "GET", "/items"], "Error: URL must be an absolute http(s) URL, such as https://api.example.com/items\n\n"),
        (["ctl", "proof", "api", "GET", "api.example.com/items"], "Error: URL must be an absolute http(s) URL, such as https://api.example.com/items\n\n"),
        (["ctl", "token", "api", "--nonce", "n"], "Error: --nonce belongs to proof\n\nUSAGE: tokenbroker ctl [--socket <path>] token "),
        (["ctl", "watch", "api", "--min-valid", "1m"], "Error: --min-valid belongs to token and proof\n\nUSAGE: tokenbroker ctl [--socket <path>] watch "),
        (["ctl", "login", "api", "--flow=code", "--refresh-token-stdin"], "Error: --flow and --refresh-token-stdin are two ways to log in: choose one\n\nUSAGE: tokenbroker ctl [--socket <path>] login "),
        (["ctl", "login", "--bogus"], "Error: unknown option '--bogus'\n\nUSAGE: tokenbroker ctl [--socket <path>] login "),
        (["ctl", "tokn", "api"], "Error: unknown verb 'tokn' (did you mean token?)\n\nUSAGE: tokenbroker ctl [--socket <path>] [--json] <verb> [<session>] [<verb options>]\n\n"
            + "Verbs: status, watch, token, recover, proof, login, logout, forget, refresh, reset-fleet-history, reload, delegate, delegations, undelegate, audit, client-key, metrics, check-config.\n"
            + "See `tokenbroker help ctl`, or `tokenbroker help ctl <verb>`.\n"),
        (["ctl", "Status"], "Error: unknown verb 'Status' (did you mean status?)\n\n"),
        (["ctl", "frobnicate"], "Error: unknown verb 'frobnicate'\n\n"),
        (["srve"], "Error: unknown subcommand or option 'srve' (did you mean serve?)\n\n"),
        (["token", "api"], "Error: unknown subcommand or option 'token' (did you mean `tokenbroker ctl token`?)\n\n"),
        (["statsu"], "Error: unknown subcommand or option 'statsu' (did you mean `tokenbroker ctl status`?)\n\n"),
    ])
    func verbUsage(arguments: [String], expected: String) {
        var out = "", err = ""
        #expect(TokenBrokerCommand.run(arguments, output: &out, errors: &err) == 64)
        #expect(err.hasPrefix(expected) && out.isEmpty, "\(err)")
        if arguments.first == "ctl" { #expect(!err.contains("SUBCOMMANDS:")) }
    }

    @Test("a code login's prompt on an 80×24 terminal keeps the URL on screen, last before the wait; a QR code only where it fits with the rest (issue 33)")
    func codeLoginPrompt() {
        let url = "http://127.0.0.1:9/authorize?response_type=code&client_id=tokenbroker&state=" + String(repeating: "s", count: 43)
            + "&code_challenge=" + String(repeating: "c", count: 43) + "&code_challenge_method=S256&redirect_uri=http%3A%2F%2F127.0.0.1%3A8400%2Fcallback"
        let small = Ctl.prompt("web", url, "http://127.0.0.1:8400/callback", expiresIn: 300, terminal: (80, 24))
        let lines = small.split(separator: "\n", omittingEmptySubsequences: false)
        let rows = lines.reduce(0) { $0 + max(1, ($1.count + 79) / 80) }
        #expect(!small.contains("█") && rows + 1 <= 24, "\(rows) rows:\n\(small)")
        #expect(lines.suffix(4).first == "  " + url[...], "the URL is last but the wait:\n\(small)")
        #expect(lines.last == "" && lines.dropLast().last == "Waiting for the login (up to 5 min)…")
        if let width = QRCode.width(url) {
            // (libqrencode4 present: what size would show the code is said, and there it is drawn.)
            #expect(small.hasPrefix("(A terminal of \(width) columns and "), "\(small)")
            let big = Ctl.prompt("web", url, "http://127.0.0.1:8400/callback", expiresIn: 300, terminal: (200, 100))
            #expect(big.contains("█") && big.hasSuffix("\n\n  \(url)\n\nWaiting for the login (up to 5 min)…\n"))
            let wideButShort = Ctl.prompt("web", url, "http://127.0.0.1:8400/callback", expiresIn: 300, terminal: (200, 24))
            #expect(!wideButShort.contains("█"))
        }
        // A terminal that does not say its size (0 × 0): nothing wraps, nothing traps.
        let unsized = Ctl.prompt("web", url, "http://127.0.0.1:8400/callback", expiresIn: 300, terminal: (0, 0))
        #expect(unsized.hasSuffix("\n\n  \(url)\n\nWaiting for the login (up to 5 min)…\n"))
        let off = Ctl.prompt("web", url, "http://127.0.0.1:8400/callback", expiresIn: 300, terminal: nil)
        #expect(!off.contains("█") && !off.contains("QR code") && off.hasPrefix("The browser comes back to http://127.0.0.1:8400/callback"))
    }

    @Test("where a verb runs follows its entry: a login on a terminal prefers tokenbroker-daemon (the QR code's library), a session named login does not")
    func verbExecution() {
        #expect(Command.prefersDaemon(["ctl", "login", "api"], terminal: true))
        #expect(Command.prefersDaemon(["ctl", "--socket", "/run/x.sock", "--json", "login", "api", "--flow=code"], terminal: true))
        #expect(!Command.prefersDaemon(["ctl", "login", "api"], terminal: false))
        #expect(!Command.prefersDaemon(["ctl", "token", "login"], terminal: true))
        #expect(!Command.prefersDaemon(["ctl", "--socket", "login", "token", "x"], terminal: true))
        #expect(!Command.prefersDaemon(["credential", "git", "login"], terminal: true))
        var out = "", err = ""
        #expect(Command.run(["ctl", "check-config", "--config", "/x"], output: &out, errors: &err) == .daemon("check-config", ["--config", "/x"]))
        #expect(CtlVerb.all.filter { $0.execution != .here }.map(\.name) == ["login", "check-config"])
    }

    @Test("the credential-protocol table drives the helpers: help's usage lines, the names tools run them by, and the Makefile's install links")
    func protocolTable() throws {
        let root = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent()
        let makefile = try String(contentsOf: root.appendingPathComponent("Makefile"), encoding: .utf8)
        let line = try #require(makefile.split(separator: "\n").first { $0.contains("for helper in ") })
        let installed = Set(line.split(separator: " ").filter { $0.hasSuffix("-tokenbroker") || $0.hasSuffix("-tokenbroker;") }
            .map { String($0.hasSuffix(";") ? $0.dropLast() : $0) })
        #expect(installed == Set(Command.helperNames.keys) && !installed.isEmpty, "\(installed)")
        for entry in CredentialProtocol.all {
            #expect(Help.credential.contains(entry.usage))
            if let link = entry.link {
                #expect(Command.arguments(invokedAs: "/usr/bin/" + link, ["get"]) == ["credential", entry.name, "get"])
                #expect(Help.credential.contains(link), "help names \(link)")
            }
        }
        #expect(CredentialHelper.protocols == ["git", "kubectl", "docker", "terraform", "bazel"])
    }

    @Test("the verb table drives ctl: every verb has help, a line in ctl --help and an implementation; the man page and operating.md name every verb")
    func verbTable() throws {
        let root = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent()
        let man = try String(contentsOf: root.appendingPathComponent("doc/tokenbroker.8"), encoding: .utf8)
        let operating = try String(contentsOf: root.appendingPathComponent("doc/operating.md"), encoding: .utf8)
        for verb in CtlVerb.all {
            #expect(Help.ctlVerb(verb.name) == verb.help)
            #expect(Help.ctl.contains("\n  " + ([verb.name] + verb.operands.map { "<\($0)>" }).joined(separator: " ")), "\(verb.name)")
            for required in ["OVERVIEW:", "USAGE:", "OPTIONS:", "EXAMPLE"] { #expect(verb.help.contains(required), "\(verb.name): \(required)") }
            for option in verb.options { #expect(verb.help.contains(option), "\(verb.name) --help names \(option)") }
            let manName = verb.name.replacingOccurrences(of: "-", with: "\\-")
            #expect(man.contains("ctl \(manName)") || verb.name == "check-config" && man.contains(".B check\\-config"), "man page: ctl \(verb.name)")
            #expect(operating.contains("ctl \(verb.name)"), "doc/operating.md: ctl \(verb.name)")
            guard verb.name != "check-config" else { continue }
            // Implemented: with its operands, it gets as far as the socket (a METHOD and URL proof takes).
            let operands = verb.operands.map { ["method": "GET", "url": "https://api.example.com/"][$0] ?? "api" }
            var out = "", err = ""
            let code = TokenBrokerCommand.run(["ctl", "--socket", "/nonexistent/tb.sock", verb.name] + operands, output: &out, errors: &err)
            // (recover reads a token, delegate needs its --socket, before the broker is asked.)
            #expect(code == 69 || ["recover", "delegate"].contains(verb.name) && code == 64, "\(verb.name): \(err)")
        }
        #expect(man.contains(".B tokenbroker version") || man.contains(".B version"), "man page: version")
    }

    @Test("ctl against no broker: exit 69 and what to do: no socket there, or nothing listening (issue 33)")
    func unreachable() throws {
        let result = Self.run("ctl", "--socket", "/nonexistent/tb.sock", "status")
        #expect(result == (69, "", "Error: no broker socket at /nonexistent/tb.sock; --socket or TOKENBROKER_SOCKET names another broker\n"))
        // A socket file nobody listens on (a broker that died without removing it).
        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("tb-cli-\(getpid())").path
        try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(atPath: directory) }
        let path = directory + "/dead.sock"
        close(try UnixSocket.listen(path: path))   // the file stays, with nobody behind it
        let refused = Self.run("ctl", "--socket", path, "status")
        #expect(refused == (69, "", "Error: nothing listens at \(path): the broker is not running\n"))
    }

    @Test("check-config: OK line, or file:line and exit 78")
    func checkConfig() throws {
        let good = try ConfigFixture(main: "[Session]\nName=api\nUpstream=test\n")
        let ok = Self.run("check-config", "--config", good.main)
        #expect(ok.code == 0 && ok.out == "\(good.main): OK, 1 session(s): api\n")
        // Many sessions: a count and the first few, every one with --verbose.
        let many = try ConfigFixture(main: (1...7).map { "[Session]\nName=s\($0)\nUpstream=test\n" }.joined())
        let short = Self.run("check-config", "--config", many.main)
        #expect(short.code == 0 && short.out == "\(many.main): OK, 7 session(s): s1, s2, s3, s4, s5, … (--verbose lists all)\n")
        let verbose = Self.run("check-config", "--config", many.main, "--verbose")
        #expect(verbose.code == 0 && verbose.out == "\(many.main): OK, 7 session(s):\n" + (1...7).map { "  s\($0)\n" }.joined())
        let bad = try ConfigFixture(main: "[Session]\nName=api\nUpstream=test\nRefreshAhead=never\n")
        let failed = Self.run("check-config", "--config", bad.main)
        #expect(failed.code == 78 && failed.err.hasPrefix("Error: \(bad.main):4: RefreshAhead="))
    }

    @Test("check-config reports every error and warning in file order, the typo's 'did you mean' kept before the error it causes (issue 33)")
    func checkConfigEveryError() throws {
        let fixture = try ConfigFixture(main: """
            [Broker]
            MaxConection=5
            [Session]
            Name=api
            TokenEndpoint=https://auth.example.com/token
            ClientID=x
            ClientSecretFle=/etc/secret
            RefreshAhead=never
            [Bad
            Foo=bar
            [Session]
            Name=ok
            Upstream=test

            """, dropIns: ["10-b.conf": "[Session]\nName=b\nUpstream=tost\n", "20-c.conf": "[Session]\nName=c\nUpstream=test\nBackoffMax=x\n"])
        let result = Self.run("check-config", "--config", fixture.main)
        let main = fixture.main, dropIns = fixture.directory + "/tokenbroker.conf.d"
        #expect(result.code == 78 && result.out.isEmpty)
        #expect(result.err == """
            warning: \(main):2: unknown key MaxConection= in [Broker], ignored (did you mean MaxConnections=?)
            Error: \(main):3: [Session] api needs ClientSecretFile= or ClientSecretCredential= (or ClientAuthentication=none); \
            line 7 has ClientSecretFle=: did you mean ClientSecretFile=?
            warning: \(main):7: unknown key ClientSecretFle= in [Session] api, ignored (did you mean ClientSecretFile=?)
            Error: \(main):8: RefreshAhead= needs a time span between 0.0s and 86400.0s, e.g. 60s or 5min
            Error: \(main):9: malformed section header (expected '[Name]')
            Error: \(dropIns)/10-b.conf:3: Upstream= must be 'oauth' or 'test'
            Error: \(dropIns)/20-c.conf:4: BackoffMax= needs a time span between 0.01s and 86400.0s, e.g. 60s or 5min
            \(main): 5 error(s), 2 warning(s)

            """, "\(result.err)")
        // The daemon's error is the first; it carries the rest (a reload's answer lists them all).
        #expect(throws: ConfigError.self) { try fixture.load() }
        do { _ = try fixture.load() } catch {
            #expect(error.further.count == 4 && error.warnings.count == 2 && "\(error)".split(separator: "\n").count == 5)
        }
        // Bounded: a file of a thousand bad lines reports the first hundred and counts the rest.
        let flood = try ConfigFixture(main: "[Session]\nName=a\nUpstream=test\n" + String(repeating: "RefreshAhead=x\n", count: 1000))
        let flooded = Self.run("check-config", "--config", flood.main)
        #expect(flooded.code == 78 && flooded.err.split(separator: "\n").count == ConfigError.most + 2)
        #expect(flooded.err.hasSuffix("(and 900 more errors)\n\(flood.main): 1000 error(s), 0 warning(s)\n"))
    }

    @Test("check-config of a configuration without sessions says it serves nothing, and how to add one (issue 33)")
    func checkConfigNoSessions() throws {
        let empty = try ConfigFixture(main: "[Broker]\n")
        let result = Self.run("check-config", "--config", empty.main)
        #expect(result == (0, "\(empty.main): OK, but it defines no session: every call would be told NoSuchSession; "
                           + "add a [Session] (a drop-in in \(empty.main).d/; one to copy: /usr/share/doc/tokenbroker/examples/example.conf)\n", ""))
    }
}

