#if canImport(Glibc)
import Glibc
#endif
import Basics
import Varlink

/// `tokenbroker ctl …`: talks to the running broker over its socket.
enum Ctl {
    struct Failure: Error {
        var code: Int32
        var message: String
    }

    static func run(_ arguments: [String], output: inout some TextOutput, errors: inout some TextOutput) -> Int32 {
        var socket = getenv("TOKENBROKER_SOCKET").map { String(cString: $0) } ?? BrokerConfiguration.defaultSocket
        var words: [String] = []
        var json = false
        var refreshTokenFromStdin = false
        var showToken = false
        var index = 0
        while index < arguments.count {
            let argument = arguments[index]
            switch argument {
            case "-h", "--help":
                output.write(words.first.flatMap(Help.ctlVerb) ?? Help.ctl)
                return ExitCode.ok
            case "--socket":
                guard index + 1 < arguments.count else { return usage("--socket needs a path", &errors) }
                socket = arguments[index + 1]
                index += 1
            case "--json":
                json = true
            case "--refresh-token-stdin":
                refreshTokenFromStdin = true
            case "--show-token":
                showToken = true
            default:
                if argument.hasPrefix("--socket=") {
                    socket = String(argument.dropFirst("--socket=".count))
                } else if argument.hasPrefix("-") {
                    return usage("unknown option '\(argument)'", &errors)
                } else if argument == "check-config" && words.isEmpty {
                    // The same as `tokenbroker check-config`: it reads files, not the socket.
                    return TokenBrokerCommand.checkConfig(Array(arguments[(index + 1)...]), output: &output, errors: &errors)
                } else {
                    words.append(argument)
                }
            }
            index += 1
        }
        guard let verb = words.first else { return usage("missing verb", &errors) }
        if refreshTokenFromStdin && verb != "login" { return usage("--refresh-token-stdin belongs to login", &errors) }
        if showToken && verb != "watch" { return usage("--show-token belongs to watch", &errors) }
        let operands = Array(words.dropFirst())
        guard let address = VarlinkAddress(socket) else { return usage("invalid socket address '\(socket)'", &errors) }
        do {
            switch verb {
            case "status":
                guard operands.isEmpty else { return usage("status takes no operand", &errors) }
                let reply = try call(address, "Status", [:])
                output.write(json ? JSON.object(reply.parameters).text + "\n" : statusTable(reply.parameters["sessions"]?.arrayValue ?? []))
            case "token":
                guard operands.count == 1 else { return usage("token needs exactly one SESSION", &errors) }
                let reply = try call(address, "GetToken", ["session": .string(operands[0])])
                guard let token = reply.parameters["token"]?.stringValue else { throw Failure(code: ExitCode.failure, message: "the broker sent no token") }
                output.write(json ? JSON.object(reply.parameters).text + "\n" : token + "\n")
            case "recover":
                guard operands.count == 1 else { return usage("recover needs exactly one SESSION", &errors) }
                let rejected = readStandardInput()
                guard !rejected.isEmpty else { return usage("recover reads the rejected token from standard input, which is empty", &errors) }
                let reply = try call(address, "Recover", ["session": .string(operands[0]), "rejected": .string(rejected)])
                guard let token = reply.parameters["token"]?.stringValue else { throw Failure(code: ExitCode.failure, message: "the broker sent no token") }
                output.write(json ? JSON.object(reply.parameters).text + "\n" : token + "\n")
            case "login":
                guard operands.count == 1 else { return usage("login needs exactly one SESSION", &errors) }
                if refreshTokenFromStdin {
                    let token = readStandardInput()
                    guard !token.isEmpty else { return usage("--refresh-token-stdin: standard input is empty", &errors) }
                    let reply = try call(address, "Login", ["session": .string(operands[0]), "refreshToken": .string(token)])
                    output.write("logged in \(operands[0]) (generation \(reply.parameters["generation"]?.intValue ?? 0))\n")
                } else {
                    try deviceLogin(address, operands[0], output: &output)
                }
            case "refresh":
                guard operands.count == 1 else { return usage("refresh needs exactly one SESSION", &errors) }
                let reply = try call(address, "Refresh", ["session": .string(operands[0])])
                if json {
                    output.write(JSON.object(reply.parameters).text + "\n")
                } else {
                    let expiry = reply.parameters["expiresAt"]?.intValue.map { ", expires \(UTCTime.timestamp($0))" } ?? ""
                    output.write("refreshed \(operands[0]): token #\(reply.parameters["tokenSerial"]?.intValue ?? 0), "
                                 + "generation \(reply.parameters["generation"]?.intValue ?? 0)\(expiry)\n")
                }
            case "watch":
                guard operands.count == 1 else { return usage("watch needs exactly one SESSION", &errors) }
                try watch(address, operands[0], json: json, showToken: showToken, output: &output)
            case "reload":
                guard operands.isEmpty else { return usage("reload takes no operand", &errors) }
                _ = try call(address, "Reload", [:])
                output.write("reloaded\n")
            case "forget":
                guard operands.count == 1 else { return usage("forget needs exactly one SESSION", &errors) }
                _ = try call(address, "Forget", ["session": .string(operands[0])])
                output.write("forgot \(operands[0])\n")
            case "logout":
                guard operands.count == 1 else { return usage("logout needs exactly one SESSION", &errors) }
                _ = try call(address, "Logout", ["session": .string(operands[0])])
                output.write("logged out \(operands[0])\n")
            default:
                return usage("unknown verb '\(verb)'", &errors)
            }
            return ExitCode.ok
        } catch let failure as Failure {
            errors.write("Error: \(failure.message)\n")
            return failure.code
        } catch {
            errors.write("Error: \(error)\n")
            return ExitCode.failure
        }
    }

    private static func usage(_ message: String, _ errors: inout some TextOutput) -> Int32 {
        errors.write("Error: \(message)\n\n" + Help.ctl)
        return ExitCode.usage
    }

    /// The device flow: show where to approve, then wait for the daemon to finish the login.
    static func deviceLogin(_ address: VarlinkAddress, _ session: String, output: inout some TextOutput) throws(Failure) {
        let client: VarlinkClient
        do {
            // The user has as long as the code lives (minutes) to approve.
            client = try VarlinkClient(address: address, timeout: 1800)
        } catch {
            throw Failure(code: ExitCode.unavailable, message: "cannot reach the broker at \(address.path): \(error) (is tokenbroker running?)")
        }
        var reply = try exchange(address, "DeviceLogin", ["session": .string(session)]) { (method, parameters) throws(VarlinkClientError) -> VarlinkReply in
            try client.call(VarlinkCall(method: method, parameters: parameters, more: true))
        }
        if reply.parameters["event"] == "prompt" {
            let uri = reply.parameters["verificationUri"]?.stringValue ?? "?"
            let code = reply.parameters["userCode"]?.stringValue ?? "?"
            output.write("To log in '\(session)', open \(uri) and enter the code \(code)\n")
            if let complete = reply.parameters["verificationUriComplete"]?.stringValue { output.write("(or open \(complete))\n") }
            output.write("Waiting for approval…\n")
            reply = try exchange(address, "DeviceLogin", ["session": .string(session)]) { (_, _) throws(VarlinkClientError) -> VarlinkReply in
                try client.nextReply()
            }
        }
        output.write("logged in \(session) (generation \(reply.parameters["generation"]?.intValue ?? 0))\n")
    }

    /// Watch: one line per event until the session signs out (or the broker goes away).
    static func watch(_ address: VarlinkAddress, _ session: String, json: Bool, showToken: Bool, output: inout some TextOutput) throws(Failure) {
        let client: VarlinkClient
        do {
            client = try VarlinkClient(address: address, timeout: 0)
        } catch {
            throw Failure(code: ExitCode.unavailable, message: "cannot reach the broker at \(address.path): \(error) (is tokenbroker running?)")
        }
        var first = true
        while true {
            let reply = try exchange(address, "Watch", ["session": .string(session)]) { (method, parameters) throws(VarlinkClientError) -> VarlinkReply in
                first ? try client.call(VarlinkCall(method: method, parameters: parameters, more: true)) : try client.nextReply()
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

    /// One call to `io.tokenbroker.Broker`; errors become messages that say what to do next.
    static func call(_ address: VarlinkAddress, _ method: String, _ parameters: JSONObject) throws(Failure) -> VarlinkReply {
        try exchange(address, method, parameters) { (method, parameters) throws(VarlinkClientError) -> VarlinkReply in
            try VarlinkClient(address: address, timeout: 60).call(method, parameters)
        }
    }

    /// Runs `send` (one call or reply read) and maps what goes wrong to a `Failure`.
    static func exchange(_ address: VarlinkAddress, _ method: String, _ parameters: JSONObject,
                         _ send: (String, JSONObject) throws(VarlinkClientError) -> VarlinkReply) throws(Failure) -> VarlinkReply {
        let reply: VarlinkReply
        do {
            reply = try send(BrokerInterface.name + "." + method, parameters)
        } catch {
            switch error {
            case let .unreachable(cause):
                throw Failure(code: ExitCode.unavailable,
                              message: "cannot reach the broker at \(address.path): \(cause) (is tokenbroker running? use --socket or TOKENBROKER_SOCKET)")
            default:
                throw Failure(code: ExitCode.unavailable, message: "the broker at \(address.path) did not answer: \(error)")
            }
        }
        guard let error = reply.error else { return reply }
        let session = reply.parameters["session"]?.stringValue ?? parameters["session"]?.stringValue ?? ""
        switch error {
        case BrokerInterface.Error.noSuchSession:
            throw Failure(code: ExitCode.failure, message: "no session named '\(session)' (see `tokenbroker ctl status`)")
        case BrokerInterface.Error.signedOut:
            throw Failure(code: ExitCode.failure, message: "not logged in: run `tokenbroker ctl login \(session)`")
        case BrokerInterface.Error.permissionDenied:
            throw Failure(code: ExitCode.permission, message: "permission denied: this user may not call \(method)\(session.isEmpty ? "" : " on '\(session)'")")
        case BrokerInterface.Error.refreshFailed:
            let reason = reply.parameters["reason"]?.stringValue ?? "unknown"
            let retryable = reply.parameters["retryable"]?.boolValue ?? false
            var message = "refresh of '\(session)' failed: \(reason)"
            if !retryable { message += "; the session has ended: run `tokenbroker ctl login \(session)`" }
            if let after = reply.parameters["retryAfter"]?.doubleValue { message += "; retry in \(seconds(after))" }
            throw Failure(code: ExitCode.failure, message: message)
        case BrokerInterface.Error.throttled:
            let after = reply.parameters["retryAfter"]?.doubleValue ?? 0
            throw Failure(code: ExitCode.failure, message: "refresh limit reached for '\(session)': retry in \(seconds(after))")
        case BrokerInterface.Error.sessionConfigured:
            throw Failure(code: ExitCode.failure, message: "'\(session)' is still configured: remove it from the configuration and reload first")
        case BrokerInterface.Error.storeFailed:
            throw Failure(code: ExitCode.failure, message: "the state of '\(session)' could not be written: \(reply.parameters["reason"]?.stringValue ?? "")")
        case BrokerInterface.Error.loginFailed:
            throw Failure(code: ExitCode.failure, message: "login of '\(session)' failed: \(reply.parameters["reason"]?.stringValue ?? "unknown")")
        case BrokerInterface.Error.configurationError:
            throw Failure(code: ExitCode.config, message: "configuration error: \(reply.parameters["reason"]?.stringValue ?? "")")
        default:
            throw Failure(code: ExitCode.failure, message: "the broker answered \(error)")
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


    static func statusTable(_ sessions: [JSON]) -> String {
        guard !sessions.isEmpty else { return "no sessions\n" }
        var now = timespec()
        clock_gettime(CLOCK_REALTIME, &now)
        let header = ["SESSION", "STATE", "GEN", "EXPIRES", "REFRESHED", "REFRESHES", "JOINED", "FAILURES", "STALE", "FLAGS"]
        var rows = [header]
        for case let .object(entry) in sessions {
            func int(_ key: String) -> Int64? { entry[key]?.intValue }
            var flags: [String] = []
            if entry["refreshing"]?.boolValue == true { flags.append("refreshing") }
            if entry["degraded"]?.boolValue == true { flags.append("degraded") }
            if entry["inert"]?.boolValue == true { flags.append("inert (not configured; ctl forget)") }
            if let backoff = entry["backoffRemaining"]?.doubleValue { flags.append("backoff \(seconds(backoff))") }
            rows.append([
                entry["name"]?.stringValue ?? "?",
                entry["state"]?.stringValue ?? "?",
                int("generation").map(String.init) ?? "-",
                int("expiresAt").map { span($0 - Int64(now.tv_sec)) } ?? "-",
                int("lastRefresh").map { span(Int64(now.tv_sec) - $0) + " ago" } ?? "-",
                int("fetches").map(String.init) ?? "0",
                int("joinedWaiters").map(String.init) ?? "0",
                int("failures").map(String.init) ?? "0",
                int("staleRejections").map(String.init) ?? "0",
                flags.isEmpty ? "-" : flags.joined(separator: ","),
            ])
        }
        let widths = header.indices.map { column in rows.map { $0[column].count }.max() ?? 0 }
        return rows.map { row in
            row.indices.map { column in
                column == row.count - 1 ? row[column] : row[column] + String(repeating: " ", count: widths[column] - row[column].count)
            }.joined(separator: "  ")
        }.joined(separator: "\n") + "\n"
    }
}

/// Where command output goes: standard output or error in the binary, a string in tests.
public protocol TextOutput {
    mutating func write(_ text: String)
}

/// A file descriptor as a `TextOutput`.
public struct FileOutput: TextOutput, Sendable {
    public let fd: Int32
    public static let standardOutput = FileOutput(fd: 1)
    public static let standardError = FileOutput(fd: 2)

    public mutating func write(_ text: String) {
        var bytes = Array(text.utf8)
        var offset = 0
        while offset < bytes.count {
            let n = bytes.withUnsafeMutableBytes { Glibc.write(fd, $0.baseAddress! + offset, $0.count - offset) }
            if n > 0 { offset += n } else if n < 0 && errno == EINTR { continue } else { return }
        }
    }
}

extension String: TextOutput {}
