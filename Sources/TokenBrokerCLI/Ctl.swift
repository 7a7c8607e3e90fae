#if canImport(Glibc)
import Glibc
#endif
import Basics
import BrokerContract
import Varlink

/// `tokenbroker ctl …`: talks to the running broker over its socket.
public enum Ctl {
    public struct Failure: Error {
        public var code: Int32
        public var message: String
        /// A usage error: the message is followed by the verb's usage.
        var showsUsage = false

        public init(code: Int32, message: String) {
            self.code = code
            self.message = message
        }

        init(usage message: String) {
            self.init(code: ExitCode.usage, message: message)
            showsUsage = true
        }
    }

    /// Parses `ctl`'s options and runs its verb; `ctl check-config` is handed back (the daemon's
    /// executable runs it).
    public static func run(_ arguments: [String], output: inout some TextOutput, errors: inout some TextOutput) -> Command.Outcome {
        // (Found only when no --socket names one: finding it looks at the user's own socket.)
        var socket: String?
        var words: [String] = []
        var json = false
        var refreshTokenFromStdin = false
        var showToken = false
        var nonce: String?
        var flow: LoginFlow?
        var minValid: Int64?
        var resource: String?
        var scope: String?
        /// Options with a value that only `delegate` or `audit` takes, and `delegate`'s `--socket` (after the verb).
        var values: [String: String] = [:]
        var index = 0
        // A usage error names the verb's usage once the verb is known.
        func usage(_ message: String, _ errors: inout some TextOutput) -> Int32 {
            Ctl.usage(message, words.first.flatMap(CtlVerb.named), &errors)
        }
        while index < arguments.count {
            let argument = arguments[index]
            switch argument {
            case "-h", "--help":
                output.write(words.first.flatMap(Help.ctlVerb) ?? Help.ctl)
                return .exit(ExitCode.ok)
            case "--socket":
                guard index + 1 < arguments.count else { return .exit(usage("--socket needs a path", &errors)) }
                // After `delegate`, the delegation's socket; before it, the broker's.
                if words.first == "delegate" { values["--socket"] = arguments[index + 1] } else { socket = arguments[index + 1] }
                index += 1
            case _ where CtlVerb.valueOptions.contains(argument):
                guard index + 1 < arguments.count else { return .exit(usage("\(argument) needs a value", &errors)) }
                values[argument] = arguments[index + 1]
                index += 1
            case "--json":
                json = true
            case "--rotate", "--promote", "--retire", "--jwk":
                values[argument] = ""
            case "--refresh-token-stdin":
                refreshTokenFromStdin = true
            case "--show-token":
                showToken = true
            case "--nonce":
                guard index + 1 < arguments.count else { return .exit(usage("--nonce needs the server's nonce", &errors)) }
                nonce = arguments[index + 1]
                index += 1
            case "--resource":
                guard index + 1 < arguments.count, TokenKey.isResource(arguments[index + 1]) else {
                    return .exit(usage("--resource needs an absolute URL without a fragment (RFC 8707), at most 512 bytes", &errors))
                }
                index += 1
                resource = arguments[index]
            case "--scope":
                guard index + 1 < arguments.count, !arguments[index + 1].split(separator: " ").isEmpty else {
                    return .exit(usage("--scope needs scope words, space-separated (one argument: quote them)", &errors))
                }
                index += 1
                scope = arguments[index]
            case "--min-valid":
                guard index + 1 < arguments.count, let seconds = duration(arguments[index + 1]) else {
                    return .exit(usage("--min-valid needs a duration such as 10m, 90s or 1h30m (at most a year)", &errors))
                }
                minValid = seconds
                index += 1
            case "--flow":
                guard index + 1 < arguments.count, let chosen = LoginFlow(rawValue: arguments[index + 1]) else {
                    return .exit(usage("--flow needs code or device", &errors))
                }
                flow = chosen
                index += 1
            default:
                if argument.hasPrefix("--min-valid=") {
                    guard let seconds = duration(String(argument.dropFirst("--min-valid=".count))) else {
                        return .exit(usage("--min-valid needs a duration such as 10m, 90s or 1h30m (at most a year)", &errors))
                    }
                    minValid = seconds
                } else if argument.hasPrefix("--flow=") {
                    guard let chosen = LoginFlow(rawValue: String(argument.dropFirst("--flow=".count))) else {
                        return .exit(usage("--flow needs code or device", &errors))
                    }
                    flow = chosen
                } else if argument.hasPrefix("--socket=") {
                    socket = String(argument.dropFirst("--socket=".count))
                } else if argument.hasPrefix("-") {
                    return .exit(usage("unknown option '\(argument)'", &errors))
                } else if words.isEmpty, CtlVerb.execution(of: argument) == .daemon {
                    // `ctl check-config`, the same as `tokenbroker check-config`: it reads files, not the socket.
                    return .daemon("check-config", Array(arguments[(index + 1)...]))
                } else {
                    words.append(argument)
                }
            }
            index += 1
        }
        return .exit(perform(words, socket: socket ?? BrokerContract.socket(), json: json, refreshTokenFromStdin: refreshTokenFromStdin, showToken: showToken,
                             nonce: nonce, flow: flow, minValid: minValid, key: TokenKey(resource: resource, scope: scope),
                             values: values, output: &output, errors: &errors))
    }

    /// A duration on the command line: `90`, `90s`, `10m`, `1h30m`, `2d` (seconds, 1 to a year).
    static func duration(_ text: String) -> Int64? {
        guard !text.isEmpty, text.utf8.count <= 32 else { return nil }
        var total: Int64 = 0, number: Int64?
        for byte in text.utf8 {
            if (0x30...0x39).contains(byte) {
                number = (number ?? 0) * 10 + Int64(byte - 0x30)
                guard number! <= BrokerRequest.longestMinValid else { return nil }
                continue
            }
            let unit: Int64
            switch byte {
            case UInt8(ascii: "s"): unit = 1
            case UInt8(ascii: "m"): unit = 60
            case UInt8(ascii: "h"): unit = 3600
            case UInt8(ascii: "d"): unit = 86400
            default: return nil
            }
            guard let value = number else { return nil }
            total += value * unit
            number = nil
            guard total <= BrokerRequest.longestMinValid else { return nil }
        }
        total += number ?? 0
        return (1...BrokerRequest.longestMinValid).contains(total) ? total : nil
    }

    /// What a verb's handler is given: where the broker is, its operands, and the options.
    struct Invocation {
        let address: VarlinkAddress
        let operands: [String]
        let json: Bool
        let refreshTokenFromStdin: Bool
        let showToken: Bool
        let nonce: String?
        let flow: LoginFlow?
        let minValid: Int64?
        /// `--resource`, `--scope`: a key of the session.
        let key: TokenKey?
        /// `delegate`'s options with their values (its `--socket` among them).
        let values: [String: String]

        var session: String { operands[0] }
    }

    /// Runs the verb `words[0]` by its entry in `CtlVerb.all`, once its operands and options
    /// are what the entry says.
    private static func perform<Output: TextOutput>(_ words: [String], socket: String, json: Bool, refreshTokenFromStdin: Bool, showToken: Bool,
                                                    nonce: String?, flow: LoginFlow?, minValid: Int64?, key: TokenKey?, values: [String: String],
                                                    output: inout Output,
                                                    errors: inout some TextOutput) -> Int32 {
        guard let verb = words.first else { return usage("missing verb", nil, &errors) }
        guard let entry = CtlVerb.named(verb) else {
            let hint = CtlVerb.suggestion(for: verb).map { " (did you mean \($0)?)" } ?? ""
            return usage("unknown verb '\(verb.prefix(64))'\(hint)", nil, &errors)
        }
        var given: [String] = []
        if refreshTokenFromStdin { given.append("--refresh-token-stdin") }
        if flow != nil { given.append("--flow") }
        if showToken { given.append("--show-token") }
        if nonce != nil { given.append("--nonce") }
        if minValid != nil { given.append("--min-valid") }
        if key?.resource != nil { given.append("--resource") }
        if key?.scope != nil { given.append("--scope") }
        if !values.isEmpty { given += values.keys.filter { $0 != "--socket" }.sorted() }
        for option in given where !entry.options.contains(option) {
            let takers = CtlVerb.takers(of: option)
            let named = takers.count < 3 ? takers.joined(separator: " and ") : takers.dropLast().joined(separator: ", ") + " and " + takers.last!
            return usage("\(option) belongs to \(named)", entry, &errors)
        }
        if flow != nil && refreshTokenFromStdin { return usage("--flow and --refresh-token-stdin are two ways to log in: choose one", entry, &errors) }
        let operands = Array(words.dropFirst())
        guard operands.count == entry.operands.count || (entry.variadic && operands.count > entry.operands.count) else {
            return usage(entry.operandRule, entry, &errors)
        }
        guard let address = address(socket) else {
            return usage("invalid socket address '\(socket)' (a path, @abstract or unix:path)", entry, &errors)
        }
        let invocation = Invocation(address: address, operands: operands, json: json, refreshTokenFromStdin: refreshTokenFromStdin,
                                    showToken: showToken, nonce: nonce, flow: flow, minValid: minValid, key: key, values: values)
        // (The handlers write to an existential; it holds the same value, handed back after.)
        var sink: any TextOutput = output
        defer { output = sink as! Output }
        do {
            try entry.handler(invocation, &sink)
            return ExitCode.ok
        } catch {
            if error.showsUsage { return usage(error.message, entry, &errors) }
            // (Empty: said already.)
            if !error.message.isEmpty { errors.write("Error: \(error.message)\n") }
            return error.code
        }
    }

    // MARK: - The verbs' handlers (CtlVerb.all names them)

    static func status(_ call: Invocation, _ output: inout any TextOutput) throws(Failure) {
        let reply = try Ctl.call(call.address, .status)
        output.write(call.json ? JSON.object(reply.parameters).text + "\n" : statusTable(StatusEntry.entries(of: reply)))
    }

    static func token(_ call: Invocation, _ output: inout any TextOutput) throws(Failure) {
        let reply = try Ctl.call(call.address, .getToken(session: call.session, minValid: call.minValid, key: call.key))
        guard let token = reply.parameters["token"]?.stringValue else { throw Failure(code: ExitCode.failure, message: "the broker sent no token") }
        output.write(call.json ? JSON.object(reply.parameters).text + "\n" : token + "\n")
    }

    static func recover(_ call: Invocation, _ output: inout any TextOutput) throws(Failure) {
        let rejected = readStandardInput()
        guard !rejected.isEmpty else { throw Failure(usage: "recover reads the rejected token from standard input, which is empty") }
        let reply = try Ctl.call(call.address, .recover(session: call.session, rejected: rejected, key: call.key))
        guard let token = reply.parameters["token"]?.stringValue else { throw Failure(code: ExitCode.failure, message: "the broker sent no token") }
        output.write(call.json ? JSON.object(reply.parameters).text + "\n" : token + "\n")
    }

    static func proof(_ call: Invocation, _ output: inout any TextOutput) throws(Failure) {
        if let problem = proofOperandProblem(method: call.operands[1], url: call.operands[2]) { throw Failure(usage: problem) }
        let reply = try Ctl.call(call.address, .getProof(session: call.session, method: call.operands[1], uri: call.operands[2], nonce: call.nonce,
                                                         rejected: nil, minValid: call.minValid, key: call.key))
        let proof = ProofReply(reply.parameters)
        guard !proof.token.token.isEmpty else { throw Failure(code: ExitCode.failure, message: "the broker sent no token") }
        output.write(call.json ? JSON.object(reply.parameters).text + "\n" : proof.headers.map { "\($0.name): \($0.value)\n" }.joined())
    }

    static func delegate(_ call: Invocation, _ output: inout any TextOutput) throws(Failure) {
        let (path, file) = (call.values["--socket"], call.values["--file"])
        guard path != nil || file != nil else {
            throw Failure(usage: "delegate needs --socket PATH (where the delegation's socket is bound) or --file PATH (where its token file is kept)")
        }
        if let path, !path.hasPrefix("/") { throw Failure(usage: "--socket needs an absolute path for the delegation's socket") }
        if let file {
            guard file.hasPrefix("/") else { throw Failure(usage: "--file needs an absolute path for the token file") }
            guard call.operands.count == 1 else { throw Failure(usage: "--file keeps one session's token: name exactly one SESSION") }
        }
        var request = DelegationRequest(name: call.values["--name"], sessions: call.operands, socket: path, file: file)
        if let format = call.values["--format"] {
            guard file != nil else { throw Failure(usage: "--format is the token file's: give --file too") }
            guard let value = TokenFileFormat(rawValue: format) else { throw Failure(usage: "--format needs token, header or json") }
            request.format = value
        }
        if let mode = call.values["--file-mode"] {
            guard file != nil else { throw Failure(usage: "--file-mode is the token file's: give --file too") }
            guard let value = UInt32(mode, radix: 8), value & ~0o644 == 0 else {
                throw Failure(usage: "--file-mode needs an octal mode with read bits and its owner's write bit only, such as 0640")
            }
            request.fileMode = value
        }
        if let readers = call.values["--readers"] {
            guard file != nil else { throw Failure(usage: "--readers are the token file's: give --file too") }
            for word in readers.split(whereSeparator: { $0 == "," || $0 == " " }) {
                guard let uid = Identity.user(String(word)) else { throw Failure(usage: "--readers: no user '\(word.prefix(64))'") }
                request.readers.append(uid)
            }
        }
        if let ttl = call.values["--ttl"] {
            guard let seconds = duration(ttl) else { throw Failure(usage: "--ttl needs a duration such as 1h, 30m or 2d (at most a year)") }
            request.ttl = seconds
        }
        if let mode = call.values["--mode"] {
            guard let value = UInt32(mode, radix: 8), value <= 0o777 else { throw Failure(usage: "--mode needs an octal mode such as 0660") }
            request.mode = value
        }
        if let owner = call.values["--owner"] {
            guard let uid = Identity.user(owner) else { throw Failure(usage: "--owner: no user '\(owner.prefix(64))'") }
            request.user = uid
        }
        if let group = call.values["--group"] {
            guard let gid = Identity.group(group) else { throw Failure(usage: "--group: no group '\(group.prefix(64))'") }
            request.group = gid
        }
        for (option, lookup) in [("--allow-users", Identity.user(_:)), ("--allow-groups", Identity.group(_:))] {
            guard let list = call.values[option] else { continue }
            var ids: [UInt32] = []
            for word in list.split(whereSeparator: { $0 == "," || $0 == " " }) {
                guard let id = lookup(String(word)) else { throw Failure(usage: "\(option): no \(option == "--allow-users" ? "user" : "group") '\(word.prefix(64))'") }
                ids.append(id)
            }
            if option == "--allow-users" { request.allowUsers = ids } else { request.allowGroups = ids }
        }
        if let count = call.values["--max-connections"] {
            guard let value = Int(count), (1...65_536).contains(value) else { throw Failure(usage: "--max-connections needs a number from 1 to 65536") }
            request.maxConnections = value
        }
        let reply = try Ctl.call(call.address, .delegate(request))
        if call.json {
            output.write(JSON.object(reply.parameters).text + "\n")
            return
        }
        let name = reply.parameters["name"]?.stringValue ?? request.name ?? "?"
        let until = reply.parameters["expiresAt"]?.intValue.map { ", until \(UTCTime.timestamp($0))" } ?? ""
        let faces = [path.map { "on \($0)" }, file.map { "in \($0)" }].compactMap { $0 }.joined(separator: " and ")
        output.write("delegated \(call.operands.joined(separator: " ")) \(faces) as \(name)\(until)\n")
    }

    static func delegations(_ call: Invocation, _ output: inout any TextOutput) throws(Failure) {
        let reply = try Ctl.call(call.address, .delegations)
        if call.json {
            output.write(JSON.object(reply.parameters).text + "\n")
            return
        }
        let all = (reply.parameters["delegations"]?.arrayValue ?? []).compactMap { $0.objectValue.flatMap(DelegationInfo.init) }
        guard !all.isEmpty else {
            output.write("no delegations\n")
            return
        }
        var now = timespec()
        clock_gettime(CLOCK_REALTIME, &now)
        var rows = [["NAME", "SESSIONS", "SOCKET", "FILE", "EXPIRES", "FROM"]]
        for delegation in all {
            rows.append([delegation.name, delegation.sessions.joined(separator: ","), delegation.socket ?? "-", delegation.file ?? "-",
                         delegation.expiresAt.map { "in " + span($0 - Int64(now.tv_sec)) } ?? "-", delegation.configured ? "config" : "ctl"])
        }
        output.write(table(rows))
        for delegation in all {
            if let problem = delegation.problem { output.write("\(delegation.name): \(problem)\n") }
        }
    }

    static func undelegate(_ call: Invocation, _ output: inout any TextOutput) throws(Failure) {
        _ = try Ctl.call(call.address, .undelegate(name: call.operands[0]))
        if !call.json { output.write("undelegated \(call.operands[0]): its socket is closed, its file erased\n") }
    }

    static func login(_ call: Invocation, _ output: inout any TextOutput) throws(Failure) {
        if call.refreshTokenFromStdin {
            let token = readStandardInput()
            guard !token.isEmpty else { throw Failure(usage: "--refresh-token-stdin: standard input is empty") }
            let reply = try Ctl.call(call.address, .login(session: call.session, refreshToken: token))
            output.write("logged in \(call.session) (generation \(LoginReply(reply.parameters).generation))\n")
            return
        }
        let chosen: LoginFlowReply
        if let flow = call.flow {
            chosen = LoginFlowReply(flow: flow, reason: "--flow=\(flow.rawValue)")
        } else {
            chosen = try loginFlow(call.address, call.session)
        }
        switch chosen.flow {
        case .device: try deviceLogin(call.address, call.session, chosen, output: &output)
        case .code: try codeLogin(call.address, call.session, chosen, output: &output)
        }
    }

    static func refresh(_ call: Invocation, _ output: inout any TextOutput) throws(Failure) {
        let reply = try Ctl.call(call.address, .refresh(session: call.session))
        guard !call.json else { return output.write(JSON.object(reply.parameters).text + "\n") }
        let refreshed = RefreshReply(reply.parameters)
        let expiry = refreshed.expiresAt.map { ", expires \(UTCTime.timestamp($0))" } ?? ""
        output.write("refreshed \(call.session): token #\(refreshed.tokenSerial), generation \(refreshed.generation)\(expiry)\n")
    }

    static func watch(_ call: Invocation, _ output: inout any TextOutput) throws(Failure) {
        try watch(call.address, call.session, json: call.json, showToken: call.showToken, output: &output)
    }

    static func audit(_ call: Invocation, _ output: inout any TextOutput) throws(Failure) {
        var limit: Int?
        if let text = call.values["--limit"] {
            guard let value = Int(text), (1...AuditEntry.mostListed).contains(value) else {
                throw Failure(usage: "--limit needs a number from 1 to \(AuditEntry.mostListed)")
            }
            limit = value
        }
        let reply = try Ctl.call(call.address, .audit(session: call.values["--session"], limit: limit))
        if call.json {
            output.write(JSON.object(reply.parameters).text + "\n")
            return
        }
        let records = (reply.parameters["records"]?.arrayValue ?? []).compactMap { $0.objectValue.flatMap(AuditEntry.init) }
        guard !records.isEmpty else {
            output.write("no audit records\n")
            return
        }
        var rows = [["LAST", "SESSION", "TOKEN", "PEER", "UNIT", "VIA", "METHODS", "COUNT"]]
        for record in records {
            let session = record.session + (record.resource.map { " " + $0 } ?? "") + (record.scope.map { " [\($0)]" } ?? "")
            rows.append([UTCTime.timestamp(record.last), session, "#\(record.tokenSerial) (gen \(record.generation))",
                         "pid \(record.pid) uid \(record.uid) gid \(record.gid)", record.unit ?? "-", record.delegation ?? "socket",
                         record.methods.joined(separator: ","), "\(record.count)"])
        }
        output.write(table(rows))
    }

    static func clientKey(_ call: Invocation, _ output: inout any TextOutput) throws(Failure) {
        let changes = ["--rotate": ClientKeyChange.rotate, "--promote": .promote, "--retire": .retire].filter { call.values[$0.key] != nil }
        guard changes.count <= 1 else { throw Failure(usage: "--rotate, --promote and --retire are steps one at a time: give one") }
        let change = changes.first?.value ?? .show
        let reply = try Ctl.call(call.address, .clientKey(session: call.session, change: change))
        if call.json {
            output.write(JSON.object(reply.parameters).text + "\n")
            return
        }
        let keys = (reply.parameters["keys"]?.arrayValue ?? []).compactMap { $0.objectValue.flatMap(ClientKeyEntry.init) }
        let jwks = keys.compactMap { entry in (try? JSONParser.parse(Array(entry.jwk.utf8)))?.objectValue.map(JSON.object) }
        if call.values["--jwk"] != nil {
            guard let signing = zip(keys, jwks).first(where: { $0.0.role == "signing" || $0.0.role == "operator" })?.1 else {
                throw Failure(code: ExitCode.failure, message: "the session has no signing key")
            }
            output.write(signing.text + "\n")
            return
        }
        output.write(JSON.object(["keys": .array(jwks)]).text + "\n")
    }

    static func metrics(_ call: Invocation, _ output: inout any TextOutput) throws(Failure) {
        output.write(MetricsReply(try Ctl.call(call.address, .metrics).parameters).text)
    }

    static func reload(_ call: Invocation, _ output: inout any TextOutput) throws(Failure) {
        _ = try Ctl.call(call.address, .reload)
        output.write("reloaded\n")
    }

    static func forget(_ call: Invocation, _ output: inout any TextOutput) throws(Failure) {
        _ = try Ctl.call(call.address, .forget(session: call.session))
        output.write("forgot \(call.session)\n")
    }

    static func logout(_ call: Invocation, _ output: inout any TextOutput) throws(Failure) {
        _ = try Ctl.call(call.address, .logout(session: call.session))
        output.write("logged out \(call.session)\n")
    }

    static func resetFleetHistory(_ call: Invocation, _ output: inout any TextOutput) throws(Failure) {
        try resetFleetHistory(call.address, call.session, json: call.json, output: &output)
    }

    /// ResetFleetHistory: a fleet session's history started anew; says what to do next.
    static func resetFleetHistory(_ address: VarlinkAddress, _ session: String, json: Bool, output: inout some TextOutput) throws(Failure) {
        let reply: VarlinkReply
        do {
            reply = try call(address, .resetFleetHistory(session: session))
        } catch where error.code == ExitCode.usage {
            // (The broker's InvalidParameter: the session is not a fleet session.)
            throw Failure(code: ExitCode.failure, message: "'\(session)' is not a fleet session (Fleet=yes): it has no fleet history")
        }
        guard !json else { return output.write(JSON.object(reply.parameters).text + "\n") }
        let started = FleetResetReply(reply.parameters)
        output.write("started the fleet history of \(session) anew (history \(started.history), fleet generation \(started.generation)); "
                     + "every broker logs it out: run `tokenbroker ctl login \(session)`\n")
    }

    /// A usage error: the message, then the verb's usage (`ctl`'s short usage and its verbs when
    /// no verb is known).
    private static func usage(_ message: String, _ verb: CtlVerb?, _ errors: inout some TextOutput) -> Int32 {
        errors.write("Error: \(message)\n\n" + (verb?.usage ?? CtlVerb.shortUsage))
        return ExitCode.usage
    }

    /// What is wrong with `proof`'s METHOD and URL before the broker is asked (its own checks
    /// are stricter; these are the common slips, told plainly).
    static func proofOperandProblem(method: String, url: String) -> String? {
        if method.isEmpty || method.utf8.count > 32 || !method.utf8.allSatisfy({ (0x41...0x5A).contains($0) }) {
            return "METHOD is upper-case letters, such as GET or POST"
        }
        let lower = url.prefix(8).lowercased()
        if !(lower.hasPrefix("https://") || lower.hasPrefix("http://")) {
            return "URL must be an absolute http(s) URL, such as https://api.example.com/items"
        }
        return nil
    }

    /// The device flow: show where to approve, then wait for the daemon to finish the login.
    static func deviceLogin(_ address: VarlinkAddress, _ session: String, _ chosen: LoginFlowReply, output: inout some TextOutput) throws(Failure) {
        // The user has as long as the code lives (minutes) to approve.
        let client = try connect(address, timeout: 1800)
        var reply = try exchange(address, .deviceLogin(session: session)) { (call) throws(VarlinkClientError) -> VarlinkReply in
            try client.call(call)
        }
        if case let .prompt(uri, code, _, complete) = DeviceLoginEvent(reply.parameters) {
            output.write(flowLine(session, chosen))
            output.write("To log in '\(session)', open \(uri) and enter the code \(code)\n")
            if let complete { output.write("(or open \(complete))\n") }
            output.write("Waiting for approval…\n")
            reply = try exchange(address, .deviceLogin(session: session)) { (_) throws(VarlinkClientError) -> VarlinkReply in
                try client.nextReply()
            }
        }
        output.write("logged in \(session) (generation \(LoginReply(reply.parameters).generation))\n")
    }

    /// Watch: one line per event until the session signs out (or the broker goes away).
    static func watch(_ address: VarlinkAddress, _ session: String, json: Bool, showToken: Bool, output: inout some TextOutput) throws(Failure) {
        let client = try connect(address, timeout: 0)
        var first = true
        while true {
            let reply = try exchange(address, .watch(session: session)) { (call) throws(VarlinkClientError) -> VarlinkReply in
                first ? try client.call(call) : try client.nextReply()
            }
            first = false
            var event = reply.parameters
            if !showToken { event["token"] = nil }
            if json {
                output.write(JSON.object(event).text + "\n")
            } else {
                let name = event["event"]?.stringValue ?? "?"
                var line = "\(name) generation \(event["generation"]?.intValue ?? 0)"
                if let serial = event["tokenSerial"]?.intValue { line += " token #\(serial)" }
                if let expiresAt = event["expiresAt"]?.intValue { line += " expires \(UTCTime.timestamp(expiresAt))" }
                if let token = event["token"]?.stringValue { line += " token \(token)" }
                output.write(line + "\n")
            }
            guard reply.continues else { return }
        }
    }

    /// The whole of standard input, without trailing line breaks.
    static func readStandardInput() -> String {
        var bytes: [UInt8] = []
        var chunk = [UInt8](repeating: 0, count: 4096)
        while bytes.count < 1 << 20 {
            let n = chunk.withUnsafeMutableBytes { read(0, $0.baseAddress, $0.count) }
            if n > 0 { bytes += chunk[0..<n] } else if n < 0 && errno == EINTR { continue } else { break }
        }
        while let last = bytes.last, last == 0x0A || last == 0x0D { bytes.removeLast() }
        return String(decoding: bytes, as: UTF8.self)
    }

    /// The broker's address from `--socket` or `$TOKENBROKER_SOCKET`: a path, `@abstract` or
    /// `unix:path`; a plain relative path is relative to the working directory, as for
    /// `serve --socket`.
    static func address(_ socket: String) -> VarlinkAddress? {
        let plainRelative = !socket.hasPrefix("/") && !socket.hasPrefix("@") && !socket.hasPrefix("unix:")
        return VarlinkAddress(plainRelative ? CommandLinePath.absolute(socket) ?? "" : socket)
    }

    /// What a caller is told when the broker cannot be reached or does not answer: what to do
    /// about it, for the system's broker (join its group, look at its unit) and for others.
    static func unreachable(_ address: VarlinkAddress, _ error: VarlinkClientError) -> Failure {
        let system = address.path == BrokerContract.defaultSocket
        let unit = system ? "; `systemctl status tokenbroker` says why" : ""
        let message: String
        switch error {
        case let .unreachable(cause) where cause.errno == EACCES || cause.errno == EPERM:
            message = "permission denied on the broker's socket \(address.path)"
                + (system ? ": this user is not in group tokenbroker; join it (sudo usermod -aG tokenbroker $USER, then log in again)" : "")
        case let .unreachable(cause) where cause.errno == ENOENT:
            message = "no broker socket at \(address.path)" + (system ? " (is tokenbroker.socket enabled? `systemctl status tokenbroker.socket`)" : "")
                + "; --socket or TOKENBROKER_SOCKET names another broker"
        case let .unreachable(cause) where cause.errno == ECONNREFUSED:
            message = "nothing listens at \(address.path): the broker is not running" + unit
        case let .unreachable(cause):
            message = "cannot reach the broker at \(address.path): \(cause)"
        case .closed, .io:
            message = "the broker at \(address.path) closed the connection without an answer (did it fail to start?)" + unit
        case let .protocolViolation(reason):
            message = "the broker at \(address.path) did not answer in varlink: \(reason)"
        }
        return Failure(code: ExitCode.unavailable, message: message)
    }

    /// A connection for a call that streams or waits long (`timeout` seconds, 0: none).
    static func connect(_ address: VarlinkAddress, timeout: Double) throws(Failure) -> VarlinkClient {
        do {
            return try VarlinkClient(address: address, timeout: timeout)
        } catch {
            throw unreachable(address, error)
        }
    }

    /// One call to `io.tokenbroker.Broker`; errors become messages that say what to do next.
    static func call(_ address: VarlinkAddress, _ request: BrokerRequest) throws(Failure) -> VarlinkReply {
        try exchange(address, request) { (call) throws(VarlinkClientError) -> VarlinkReply in
            try VarlinkClient(address: address, timeout: 60).call(call)
        }
    }

    /// Runs `send` (one call or reply read) and maps what goes wrong to a `Failure`.
    static func exchange(_ address: VarlinkAddress, _ request: BrokerRequest,
                         _ send: (VarlinkCall) throws(VarlinkClientError) -> VarlinkReply) throws(Failure) -> VarlinkReply {
        let reply: VarlinkReply
        do {
            reply = try send(request.call)
        } catch {
            throw unreachable(address, error)
        }
        guard let name = reply.error else { return reply }
        guard let error = BrokerError(reply, session: request.session ?? "") else {
            if name == VarlinkServiceError.invalidParameter, let parameter = reply.parameters["parameter"]?.stringValue {
                throw Failure(code: ExitCode.usage, message: "the broker refused the value of '\(parameter.prefix(32))'")
            }
            throw Failure(code: ExitCode.failure, message: "the broker answered \(name)")
        }
        if case let .noSuchSession(session) = error, request.method != .status,
           let names = try? StatusEntry.entries(of: call(address, .status)).map(\.name),
           let close = Spelling.closest(to: session, in: names), close != session {
            // (Among the sessions this user may see: Status shows no other.)
            throw Failure(code: ExitCode.failure, message: "no session named '\(session)'; did you mean '\(close)'? (see `tokenbroker ctl status`)")
        }
        throw failure(error, request)
    }

    /// What `ctl` says, and exits with, for each contract error.
    static func failure(_ error: BrokerError, _ request: BrokerRequest) -> Failure {
        switch error {
        case let .noSuchSession(session):
            return Failure(code: ExitCode.failure, message: "no session named '\(session)' (see `tokenbroker ctl status`)")
        case let .signedOut(session, login):
            return Failure(code: ExitCode.failure, message: "not logged in: run `\(login.map { String($0.prefix(300)) } ?? "tokenbroker ctl login \(session)")`")
        case .permissionDenied:
            let on = request.session.map { " on '\($0)'" } ?? ""
            return Failure(code: ExitCode.permission, message: "permission denied: this user may not call \(request.method.rawValue)\(on)")
        case let .refreshFailed(session, reason, retryable, retryAfter):
            var message = "refresh of '\(session)' failed: \(reason)"
            if !retryable { message += "; the session has ended: run `tokenbroker ctl login \(session)`" }
            if let retryAfter { message += "; retry in \(seconds(retryAfter))" }
            return Failure(code: ExitCode.failure, message: message)
        case let .throttled(session, retryAfter):
            return Failure(code: ExitCode.failure, message: "refresh limit reached for '\(session)': retry in \(seconds(retryAfter))")
        case let .lifetimeTooShort(session, lifetime, minValid):
            return Failure(code: ExitCode.failure, message: "the tokens of '\(session)' live \(seconds(lifetime)), less than the \(seconds(minValid)) asked (--min-valid): "
                           + "no refresh gives a longer one; ask for less")
        case let .sessionConfigured(session):
            return Failure(code: ExitCode.failure, message: "'\(session)' is still configured: remove it from the configuration and reload first")
        case let .storeFailed(session, reason):
            return Failure(code: ExitCode.failure, message: "the state of '\(session)' could not be written: \(reason)")
        case let .loginFailed(session, reason):
            return Failure(code: ExitCode.failure, message: "login of '\(session)' failed: \(reason)")
        case let .configurationError(reason) where request.method == .reload:
            return Failure(code: ExitCode.config, message: "configuration error: \(reason)")
        case let .configurationError(reason):
            // The daemon could not start (`StartFailure`): fixed, the next call starts it again.
            return Failure(code: ExitCode.config, message: "\(reason); once it is fixed, the next call starts the broker again")
        case .shuttingDown:
            return Failure(code: ExitCode.unavailable, message: "the broker is shutting down")
        case .internalError:
            return Failure(code: ExitCode.failure, message: "the broker failed internally (see its log)")
        case let .protocolError(reason):
            return Failure(code: ExitCode.failure, message: "the broker refused the message: \(reason)")
        case let .noSuchDelegation(name):
            return Failure(code: ExitCode.failure, message: "no delegation named '\(name)' (see `tokenbroker ctl delegations`)")
        case let .delegationFailed(name, reason):
            return Failure(code: ExitCode.failure, message: "delegation '\(name)' could not be made: \(reason)")
        case let .clientKeyUnavailable(session, reason):
            return Failure(code: ExitCode.failure, message: "client key of '\(session)': \(reason)")
        }
    }

    static func seconds(_ value: Double) -> String {
        value < 10 ? "\(Double(Int(value * 10)) / 10)s" : "\(Int(value.rounded()))s"
    }

    /// A human-readable duration: `42s`, `12m`, `3h05m`, `2d04h`.
    static func span(_ seconds: Int64) -> String {
        let s = max(seconds, 0)
        if s < 60 { return "\(s)s" }
        if s < 3600 { return "\(s / 60)m" }
        if s < 86400 { return "\(s / 3600)h\(UTCTime.twoDigits(s % 3600 / 60))m" }
        return "\(s / 86400)d\(UTCTime.twoDigits(s % 86400 / 3600))h"
    }


    static func statusTable(_ sessions: [StatusEntry]) -> String {
        guard !sessions.isEmpty else { return "no sessions\n" }
        var now = timespec()
        clock_gettime(CLOCK_REALTIME, &now)
        let header = ["SESSION", "STATE", "GEN", "EXPIRES", "REFRESHED", "REFRESHES", "JOINED", "FAILURES", "STALE", "FLAGS"]
        var rows = [header]
        for entry in sessions {
            var flags: [String] = []
            if entry.refreshing { flags.append("refreshing") }
            if entry.degraded { flags.append("degraded") }
            if entry.inert { flags.append("inert (not configured; ctl forget)") }
            if let backoff = entry.backoffRemaining { flags.append("backoff \(seconds(backoff))") }
            if !entry.throttledUsers.isEmpty { flags.append("throttled uid " + entry.throttledUsers.map(String.init).joined(separator: "+")) }
            if let parent = entry.derivedFrom { flags.append("derived from \(parent)") }
            if let keys = entry.keys, keys > 0 { flags.append("\(keys) key\(keys == 1 ? "" : "s")") }
            rows.append([
                entry.name,
                entry.state,
                String(entry.generation),
                entry.expiresAt.map { span($0 - Int64(now.tv_sec)) } ?? "-",
                entry.lastRefresh.map { span(Int64(now.tv_sec) - $0) + " ago" } ?? "-",
                String(entry.counters[.fetches]),
                String(entry.counters[.joinedWaiters]),
                String(entry.counters[.failures]),
                String(entry.counters[.staleRejections]),
                flags.isEmpty ? "-" : flags.joined(separator: ","),
            ])
        }
        let widths = header.indices.map { column in rows.map { $0[column].count }.max() ?? 0 }
        var fleet = ""
        for entry in sessions {
            guard let health = entry.fleetHealth else { continue }
            fleet += "fleet \(entry.name): \(health)"
            if let generation = entry.fleetGeneration { fleet += ", fleet generation \(generation)" }
            if let revision = entry.fleetRevision { fleet += ", etcd revision \(revision)" }
            fleet += entry.flightHolder.map { ", refreshing on \($0)" } ?? ", no flight"
            fleet += "\n"
        }
        return rows.map { row in
            row.indices.map { column in
                column == row.count - 1 ? row[column] : row[column] + String(repeating: " ", count: widths[column] - row[column].count)
            }.joined(separator: "  ")
        }.joined(separator: "\n") + "\n" + fleet
    }
}

extension Ctl {
    /// Rows as columns two spaces apart (the last column unpadded).
    static func table(_ rows: [[String]]) -> String {
        guard let header = rows.first else { return "" }
        let widths = header.indices.map { column in rows.map { $0[column].count }.max() ?? 0 }
        return rows.map { row in
            row.indices.map { column in
                column == row.count - 1 ? row[column] : row[column] + String(repeating: " ", count: widths[column] - row[column].count)
            }.joined(separator: "  ")
        }.joined(separator: "\n") + "\n"
    }
}

/// Users and groups by name or number, as ctl's options give them (looked up on this host).
enum Identity {
    static func user(_ text: String) -> UInt32? {
        if let id = UInt32(text), id != UInt32.max { return id }
        guard !text.isEmpty, text.utf8.count <= 64, let entry = getpwnam(text) else { return nil }
        return entry.pointee.pw_uid
    }

    static func group(_ text: String) -> UInt32? {
        if let id = UInt32(text), id != UInt32.max { return id }
        guard !text.isEmpty, text.utf8.count <= 64, let entry = getgrnam(text) else { return nil }
        return entry.pointee.gr_gid
    }
}
