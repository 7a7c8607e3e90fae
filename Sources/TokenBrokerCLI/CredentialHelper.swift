#if canImport(Glibc)
import Glibc
#endif
import Basics
import BrokerContract
import Varlink

/// `tokenbroker credential PROTOCOL …`: the credential-helper protocols of the tools people
/// already run (git, kubectl, docker/podman/skopeo, Terraform, Bazel), each a thin relay to the
/// broker's `Credential` method, which finds the session that serves the URL for this user.
/// A helper never refreshes by itself: every process shares the session's one flight.
///
/// Whatever the input, the tool gets its protocol's answer: a credential, its "not found" (so
/// it falls through to its next helper), or its error form. Standard input is read for at most
/// `inputDeadline` and `inputLimit` bytes; a token is written only to standard output, and only
/// in the protocol's credential field.
public enum CredentialHelper {
    public static var protocols: [String] { CredentialProtocol.all.map(\.name) }
    static let inputLimit = 64 << 10
    static let inputDeadline = 5_000   // milliseconds

    /// What a helper found for a URL. (An enum of its own, not a `Result`: a generic type's
    /// first use costs a helper's start more than its whole call to the broker.)
    enum Lookup {
        case found(CredentialReply)
        case notFound
        case failed(Ctl.Failure)
    }

    /// The options a helper takes, each with a value (`--url U` or `--url=U`), by name. (Named
    /// fields rather than a dictionary, for the same reason as `Lookup`.)
    struct Options {
        static let names = ["--socket", "--username", "--url", "--session", "--resource", "--scope"]
        private var socket, username, url, session, resource, scope: String?

        subscript(name: String) -> String? {
            get {
                switch name {
                case "--socket": socket
                case "--username": username
                case "--url": url
                case "--session": session
                case "--resource": resource
                case "--scope": scope
                default: nil
                }
            }
            set {
                switch name {
                case "--socket": socket = newValue
                case "--username": username = newValue
                case "--url": url = newValue
                case "--session": session = newValue
                case "--resource": resource = newValue
                case "--scope": scope = newValue
                default: preconditionFailure("\(name) is not among Options.names")
                }
            }
        }
    }

    /// Where the helper reads its input and talks to the broker (tests give their own).
    public struct Environment {
        /// The broker's socket: `--socket`'s, or else the one a client finds by itself (looked
        /// for only when asked: finding it looks at the user's own socket).
        public var socket: String {
            get { chosenSocket ?? BrokerContract.socket() }
            set { chosenSocket = newValue }
        }
        private var chosenSocket: String?
        public var standardInput: () -> [UInt8]?
        public var variable: (String) -> String?
        public var now: () -> Int64
        /// What decides a registry's bare host's scheme (the docker protocol).
        var registries: RegistryTransport = .process

        public static var process: Environment {
            Environment(socket: nil,
                        standardInput: { readInput() }, variable: { name in getenv(name).map { String(cString: $0) } },
                        now: { Int64(time(nil)) })
        }

        public init(socket: String?, standardInput: @escaping () -> [UInt8]?, variable: @escaping (String) -> String?, now: @escaping () -> Int64) {
            (chosenSocket, self.standardInput, self.variable, self.now) = (socket, standardInput, variable, now)
        }
    }

    public static func run(_ arguments: [String], output: inout some TextOutput, errors: inout some TextOutput,
                           environment: Environment = .process) -> Int32 {
        var environment = environment
        var words: [String] = []
        var options = Options()
        var index = 0
        while index < arguments.count {
            let argument = arguments[index]
            if argument == "-h" || argument == "--help" {
                output.write(Help.credential)
                return ExitCode.ok
            }
            if let option = Options.names.first(where: { argument == $0 || argument.hasPrefix($0 + "=") }) {
                if argument == option {
                    guard index + 1 < arguments.count else { return usage("\(option) needs a value", &errors) }
                    options[option] = arguments[index + 1]
                    index += 1
                } else {
                    options[option] = String(argument.dropFirst(option.count + 1))
                }
            } else if argument.hasPrefix("-") {
                return usage("unknown option '\(argument)'", &errors)
            } else {
                words.append(argument)
            }
            index += 1
        }
        if let socket = options["--socket"] { environment.socket = socket }
        if let resource = options["--resource"], !TokenKey.isResource(resource) {
            return usage("--resource needs an absolute URL without a fragment (RFC 8707), at most 512 bytes", &errors)
        }
        if let scope = options["--scope"], scope.split(separator: " ").isEmpty {
            return usage("--scope needs scope words, space-separated (one argument: quote them)", &errors)
        }
        guard let name = words.first else { return usage("missing protocol (one of \(protocols.joined(separator: ", ")))", &errors) }
        guard let chosen = CredentialProtocol.named(name) else {
            return usage("unknown protocol '\(name.prefix(64))' (one of \(protocols.joined(separator: ", ")))", &errors)
        }
        let relay = Relay(environment: environment, key: TokenKey(resource: options["--resource"], scope: options["--scope"]))
        let answer: CredentialProtocol.Answer
        switch chosen.plan(CredentialProtocol.Request(operands: Array(words.dropFirst()), options: options, environment: environment)) {
        case let .done(done):
            answer = done
        case let .lookup(query, replies):
            // The one place a protocol's three outcomes are told apart.
            let found: Lookup
            switch query {
            case let .url(url, rejected): found = relay.lookup(url, rejected: rejected)
            case let .session(session): found = relay.session(session)
            }
            switch found {
            case let .found(reply): answer = replies.found(reply)
            case .notFound: answer = replies.notFound
            case let .failed(failure): answer = replies.failure(failure)
            }
        }
        output.write(answer.output)
        errors.write(answer.errors)
        return answer.code
    }

    private static func usage(_ message: String, _ errors: inout some TextOutput) -> Int32 {
        errors.write("Error: \(message)\n\n" + Help.credential)
        return ExitCode.usage
    }

    // MARK: - The broker

    /// One `Credential` (or `GetToken`) call; a failure is a message for standard error.
    struct Relay {
        let environment: Environment
        /// `--resource`, `--scope`: the key of the session asked for, if any.
        var key: TokenKey?

        func lookup(_ url: String, rejected: String? = nil) -> Lookup {
            // What the broker would refuse to read is nobody's: the tool asks its next helper.
            guard !url.isEmpty, url.utf8.count <= 2048 else { return .notFound }
            let lookup = request(.credential(url: url, rejected: rejected, key: key))
            // A token the protocols could not carry as one field is not handed on.
            if case let .found(reply) = lookup, !reply.token.token.utf8.allSatisfy({ $0 > 0x20 && $0 < 0x7F }) {
                return .failed(Ctl.Failure(code: ExitCode.failure, message: "the broker's token is not visible ASCII"))
            }
            return lookup
        }

        func session(_ name: String) -> Lookup {
            let lookup = request(.getToken(session: name, key: key))
            guard case let .found(reply) = lookup else { return lookup }
            return .found(CredentialReply(session: name, token: reply.token))
        }

        private func request(_ request: BrokerRequest) -> Lookup {
            let socket = environment.socket
            guard let address = Ctl.address(socket) else {
                return .failed(Ctl.Failure(code: ExitCode.usage, message: "invalid socket address '\(socket)'"))
            }
            let reply: VarlinkReply
            do {
                reply = try VarlinkClient(address: address, timeout: 60).call(request.call)
            } catch {
                return .failed(Ctl.unreachable(address, error))
            }
            guard let name = reply.error else {
                let found = CredentialReply(reply.parameters)
                // A sender-constrained token is worthless without its proof, and these protocols
                // carry one header at most: the tool is told, and gets nothing it cannot use.
                guard found.token.tokenType.lowercased() == "bearer" else {
                    return .failed(Ctl.Failure(code: ExitCode.failure, message: "session \(found.session) has \(found.token.tokenType.prefix(16))-bound tokens "
                                                + "(DPoP=yes), which need a proof at every request: use GetProof (tokenbroker ctl proof) instead of a credential helper"))
                }
                return .found(found)
            }
            switch BrokerError(reply, session: request.session ?? "") {
            case .noSuchSession?, .permissionDenied?:
                // No session serves it for this user (or, by name, this user may not use it).
                return .notFound
            case let error?:
                return .failed(Ctl.failure(error, request))
            case nil:
                return .failed(Ctl.Failure(code: ExitCode.failure, message: "the broker answered \(name)"))
            }
        }
    }

    // MARK: - Reading input

    /// Standard input, up to `inputLimit` bytes and for at most `inputDeadline` (nil: more
    /// than that, or too slow).
    static func readInput() -> [UInt8]? {
        var bytes: [UInt8] = []
        var chunk = [UInt8](repeating: 0, count: 4096)
        var pending = pollfd(fd: 0, events: Int16(POLLIN), revents: 0)
        var start = timespec()
        clock_gettime(CLOCK_MONOTONIC, &start)
        while true {
            var now = timespec()
            clock_gettime(CLOCK_MONOTONIC, &now)
            let elapsed = Int((now.tv_sec - start.tv_sec) * 1000) + Int(now.tv_nsec - start.tv_nsec) / 1_000_000
            guard elapsed < inputDeadline else { return nil }
            let ready = poll(&pending, 1, Int32(inputDeadline - elapsed))
            if ready < 0 && errno == EINTR { continue }
            guard ready > 0 else { return nil }
            let n = chunk.withUnsafeMutableBytes { read(0, $0.baseAddress, $0.count) }
            if n > 0 {
                bytes += chunk[0..<n]
                guard bytes.count <= inputLimit else { return nil }
            } else if n < 0 && errno == EINTR {
                continue
            } else {
                return n == 0 ? bytes : nil
            }
        }
    }

    /// Whether `text` contains `://` (on bytes: `String.contains(_:)` of a string costs a
    /// helper's start more than the search).
    static func hasScheme(_ text: String) -> Bool {
        var previous: (UInt8, UInt8) = (0, 0)
        for byte in text.utf8 {
            if previous == (UInt8(ascii: ":"), UInt8(ascii: "/")) && byte == UInt8(ascii: "/") { return true }
            previous = (previous.1, byte)
        }
        return false
    }

    /// The lines of `text`, split at LF, a CR before it dropped.
    static func lines(_ text: String) -> [Substring] {
        text.utf8.split(separator: 0x0A, omittingEmptySubsequences: false).map { line in
            Substring(line.last == 0x0D ? line.dropLast() : line)
        }
    }

    /// Text input: valid UTF-8 without NUL, or nil.
    static func text(_ bytes: [UInt8]?) -> String? {
        guard let bytes, !bytes.contains(0) else { return nil }
        let text = String(decoding: bytes, as: UTF8.self)
        return Array(text.utf8) == bytes ? text : nil
    }
}
