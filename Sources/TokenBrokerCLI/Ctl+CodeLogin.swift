#if canImport(Glibc)
import Glibc
#endif
import Basics
import BrokerContract
import CLinux
import Varlink

/// `ctl login` for the authorization code flow: the daemon listens for the browser's redirect;
/// this prints where to send the browser, how to reach the listener from another machine, and
/// takes the redirect pasted on standard input when it cannot be reached at all.
extension Ctl {
    /// Which flow the daemon says suits the session (`LoginFlow`); the device flow with a
    /// daemon from before `LoginFlow`, as `ctl login` ran then.
    static func loginFlow(_ address: VarlinkAddress, _ session: String) throws(Failure) -> LoginFlowReply {
        let reply = try exchange(address, .loginFlow(session: session)) { (call) throws(VarlinkClientError) -> VarlinkReply in
            let reply = try VarlinkClient(address: address, timeout: 60).call(call)
            return reply.error == VarlinkServiceError.methodNotFound ? VarlinkReply(parameters: LoginFlowReply(flow: .device).parameters) : reply
        }
        guard let chosen = LoginFlowReply(reply.parameters) else {
            throw Failure(code: ExitCode.failure, message: "the broker named a login flow this ctl does not know; use --flow=code or --flow=device")
        }
        return chosen
    }

    /// The first line of an interactive login: which flow, and why.
    static func flowLine(_ session: String, _ chosen: LoginFlowReply) -> String {
        "Logging in '\(session)' with the \(chosen.flow == .code ? "authorization code flow (PKCE)" : "device flow")"
            + (chosen.reason.map { ": \($0.prefix(200))" } ?? "") + ".\n"
    }

    static func codeLogin(_ address: VarlinkAddress, _ session: String, _ chosen: LoginFlowReply, output: inout some TextOutput) throws(Failure) {
        // LoginTimeout= is at most an hour; the daemon ends the login then.
        let client = try connect(address, timeout: 3700)
        var request = BrokerRequest.codeLogin(session: session, refusals: true)
        var reply = try exchange(address, request) { (call) throws(VarlinkClientError) -> VarlinkReply in
            let first = try client.call(call)
            guard first.error == VarlinkServiceError.invalidParameter, first.parameters["parameter"] == "refusals" else { return first }
            // A daemon from before refusals were told: the login without them.
            request = .codeLogin(session: session)
            return try client.call(request.call)
        }
        let reported = SynchronizedBox<String?>(nil)
        if case let .prompt(uri, redirect, expiresIn) = CodeLoginEvent(reply.parameters) {
            let terminal = isatty(STDOUT_FILENO) == 1
            output.write(flowLine(session, chosen) + prompt(session, uri, redirect, expiresIn: expiresIn,
                                                            terminal: terminal ? (Int(tb_terminal_columns(STDOUT_FILENO)), Int(tb_terminal_rows(STDOUT_FILENO))) : nil))
            readPastedRedirects(address, session, reported: reported)
            do {
                // Each request the listener refuses is said (a line each; the daemon bounds them),
                // until the login's end.
                var errors = FileOutput.standardError
                while true {
                    reply = try exchange(address, request) { (_) throws(VarlinkClientError) -> VarlinkReply in
                        try client.nextReply()
                    }
                    guard case let .refused(reason) = CodeLoginEvent(reply.parameters) else { break }
                    errors.write("The listener refused \(reason.prefix(300)); the login is still waiting.\n")
                }
            } catch {
                // The paste's answer said it already.
                if reported.value == error.message { throw Failure(code: error.code, message: "") }
                throw error
            }
        }
        output.write("logged in \(session) (generation \(LoginReply(reply.parameters).generation))\n")
    }

    /// What the user reads: where the browser comes back, the two ways to log in from a
    /// browser on another machine, and last, so that it stays on screen, the URL to open. A QR
    /// code of it is drawn above on a terminal (`terminal`: its columns and rows, 0 when it does
    /// not say) only when the code and the rest fit in it together; otherwise a note says what
    /// size would show one.
    static func prompt(_ session: String, _ uri: String, _ redirect: String, expiresIn: Int64, terminal: (columns: Int, rows: Int)?) -> String {
        let port = redirect.split(separator: ":").last.map { $0.prefix(while: \.isNumber) } ?? ""
        let help = """
            The browser comes back to \(redirect) on this host, where the broker listens.
            If the browser runs on another machine, either forward that port to it first:
              ssh -L \(port):127.0.0.1:\(port) \(hostName())
            or log in there and paste here the address the browser ends on (it will not load).

            """
        let open = "\nTo log in '\(session)', open this address in a browser:\n\n  \(uri)\n\nWaiting for the login (up to \(minutes(expiresIn)))…\n"
        var code = ""
        if let terminal {
            // The lines the rest takes (the URL wraps at the terminal's width), the flow's line
            // above, and the prompt's own line after.
            // (A terminal that does not say its width wraps nothing.)
            let columns = terminal.columns > 0 ? terminal.columns : Int.max
            let wrapped = (help + open).split(separator: "\n", omittingEmptySubsequences: false).reduce(0) { lines, line in
                lines + (columns == .max ? 1 : max(1, (line.count + columns - 1) / columns))
            }
            let rows = terminal.rows > 0 ? terminal.rows : Int.max
            if let width = QRCode.width(uri) {
                let height = (width + 1) / 2
                if width <= columns && (rows == .max || height + 1 + wrapped + 2 <= rows), let drawn = QRCode.render(uri, columns: columns) {
                    code = drawn + "\n"
                } else {
                    code = "(A terminal of \(width) columns and \(height + wrapped + 3) rows would show this address as a QR code.)\n\n"
                }
            }
        }
        return code + help + open
    }

    private static func minutes(_ seconds: Int64) -> String {
        seconds % 60 == 0 ? "\(seconds / 60) min" : "\(seconds) s"
    }

    private static func hostName() -> String {
        var buffer = [CChar](repeating: 0, count: 256)
        guard gethostname(&buffer, buffer.count - 1) == 0 else { return "this-host" }
        return String(decoding: buffer.prefix(while: { $0 != 0 }).map { UInt8(bitPattern: $0) }, as: UTF8.self)
    }

    /// The longest pasted line taken, in bytes (the daemon takes no longer redirect).
    static let longestPaste = 8192

    /// Reads standard input, line by line, in a thread of its own, and offers each non-empty
    /// line to the login (`CompleteCodeLogin`); a refusal is printed (and remembered in
    /// `reported`, so that the login's end does not print it twice). Ends at end of input; the
    /// process ends with the login, whatever this thread is doing.
    private static func readPastedRedirects(_ address: VarlinkAddress, _ session: String, reported: SynchronizedBox<String?>) {
        spawnThread {
            var errors = FileOutput.standardError
            /// Offers one line (`tooLong`: it was cut at `longestPaste`).
            func offer(_ line: [UInt8], tooLong: Bool) {
                if tooLong {
                    errors.write("Not taken: that line is longer than \(longestPaste) bytes; paste only the address. The login is still waiting.\n")
                    return
                }
                let text = String(decoding: line, as: UTF8.self).trimmingSpaces()
                guard !text.isEmpty else { return }
                guard text.lowercased().hasPrefix("http://") || text.lowercased().hasPrefix("https://") else {
                    errors.write("Not taken: paste the whole address the browser ends on, starting with http://127.0.0.1: (the login is still waiting)\n")
                    return
                }
                let request = BrokerRequest.completeCodeLogin(session: session, redirectUrl: text)
                do {
                    _ = try exchange(address, request) { (call) throws(VarlinkClientError) -> VarlinkReply in
                        let reply = try VarlinkClient(address: address, timeout: 700).call(call)
                        // A paste that is not the login's answer changes nothing: not a failure.
                        if case let .loginFailed(_, reason)? = BrokerError(reply, session: session), reason.hasSuffix(CodeLoginEvent.stillWaiting) {
                            errors.write("Not taken: \(reason.dropLast(CodeLoginEvent.stillWaiting.count).prefix(300)). The login is still waiting.\n")
                            return VarlinkReply()
                        }
                        return reply
                    }
                } catch {
                    reported.value = error.message
                    errors.write("Error: \(error.message)\n")
                }
            }
            var line: [UInt8] = []
            var tooLong = false
            var buffer = [UInt8](repeating: 0, count: 4096)
            while true {
                let count = read(STDIN_FILENO, &buffer, buffer.count)
                if count < 0 && errno == EINTR { continue }
                guard count > 0 else {
                    // The end of the input ends a last line too.
                    offer(line, tooLong: tooLong)
                    return
                }
                for byte in buffer[..<count] {
                    guard byte == UInt8(ascii: "\n") else {
                        if line.count < longestPaste { line.append(byte) } else { tooLong = true }
                        continue
                    }
                    offer(line, tooLong: tooLong)
                    line = []
                    tooLong = false
                }
            }
        }
    }
}

private extension String {
    func trimmingSpaces() -> String {
        var text = Substring(self)
        while let first = text.first, first.isWhitespace { text = text.dropFirst() }
        while let last = text.last, last.isWhitespace { text = text.dropLast() }
        return String(text)
    }
}
