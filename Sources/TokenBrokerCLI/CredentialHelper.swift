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
    public static let protocols = ["git", "kubectl", "docker", "terraform", "bazel"]
    static let inputLimit = 64 << 10
    static let inputDeadline = 5_000   // milliseconds

    /// What a helper found for a URL.
    enum Lookup {
        case found(CredentialReply)
        case notFound
    }

    /// Where the helper reads its input and talks to the broker (tests give their own).
    public struct Environment {
        public var socket: String
        public var standardInput: () -> [UInt8]?
        public var variable: (String) -> String?
        public var now: () -> Int64
        /// What decides a registry's bare host's scheme (the docker protocol).
        var registries: RegistryTransport = .process

        public static var process: Environment {
            Environment(socket: BrokerContract.socket(),
                        standardInput: { readInput() }, variable: { name in getenv(name).map { String(cString: $0) } },
                        now: { Int64(time(nil)) })
        }

        public init(socket: String, standardInput: @escaping () -> [UInt8]?, variable: @escaping (String) -> String?, now: @escaping () -> Int64) {
            (self.socket, self.standardInput, self.variable, self.now) = (socket, standardInput, variable, now)
        }
    }

    public static func run(_ arguments: [String], output: inout some TextOutput, errors: inout some TextOutput,
                           environment: Environment = .process) -> Int32 {
        var environment = environment
        var words: [String] = []
        var options: [String: String] = [:]
        var index = 0
        while index < arguments.count {
            let argument = arguments[index]
            if argument == "-h" || argument == "--help" {
                output.write(Help.credential)
                return ExitCode.ok
            }
            if let option = ["--socket", "--username", "--url", "--session"].first(where: { argument == $0 || argument.hasPrefix($0 + "=") }) {
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
        guard let name = words.first else { return usage("missing protocol (one of \(protocols.joined(separator: ", ")))", &errors) }
        let operands = Array(words.dropFirst())
        let relay = Relay(environment: environment)
        switch name {
        case "git": return git(operands, username: options["--username"] ?? "oauth2", relay, &output, &errors)
        case "kubectl": return kubectl(operands, url: options["--url"], session: options["--session"], relay, &output, &errors)
        case "docker": return docker(operands, username: options["--username"] ?? "oauth2", relay, &output, &errors)
        case "terraform": return terraform(operands, relay, &output, &errors)
        case "bazel": return bazel(operands, relay, &output, &errors)
        default: return usage("unknown protocol '\(name)' (one of \(protocols.joined(separator: ", ")))", &errors)
        }
    }

    private static func usage(_ message: String, _ errors: inout some TextOutput) -> Int32 {
        errors.write("Error: \(message)\n\n" + Help.credential)
        return ExitCode.usage
    }

    // MARK: - The broker

    /// One `Credential` (or `GetToken`) call; a failure is a message for standard error.
    struct Relay {
        let environment: Environment

        func lookup(_ url: String, rejected: String? = nil) -> Result<Lookup, Ctl.Failure> {
            // What the broker would refuse to read is nobody's: the tool asks its next helper.
            guard !url.isEmpty, url.utf8.count <= 2048 else { return .success(.notFound) }
            return request(.credential(url: url, rejected: rejected)).flatMap { lookup in
                // A token the protocols could not carry as one field is not handed on.
                if case let .found(reply) = lookup, !reply.token.token.utf8.allSatisfy({ $0 > 0x20 && $0 < 0x7F }) {
                    return .failure(Ctl.Failure(code: ExitCode.failure, message: "the broker's token is not visible ASCII"))
                }
                return .success(lookup)
            }
        }

        func session(_ name: String) -> Result<Lookup, Ctl.Failure> {
            request(.getToken(session: name)).map { lookup in
                guard case let .found(reply) = lookup else { return lookup }
                return .found(CredentialReply(session: name, token: reply.token))
            }
        }

        private func request(_ request: BrokerRequest) -> Result<Lookup, Ctl.Failure> {
            let socket = environment.socket
            guard let address = Ctl.address(socket) else {
                return .failure(Ctl.Failure(code: ExitCode.usage, message: "invalid socket address '\(socket)'"))
            }
            let reply: VarlinkReply
            do {
                reply = try VarlinkClient(address: address, timeout: 60).call(request.call)
            } catch {
                return .failure(Ctl.unreachable(address, error))
            }
            guard let name = reply.error else {
                let found = CredentialReply(reply.parameters)
                // A sender-constrained token is worthless without its proof, and these protocols
                // carry one header at most: the tool is told, and gets nothing it cannot use.
                guard found.token.tokenType.lowercased() == "bearer" else {
                    return .failure(Ctl.Failure(code: ExitCode.failure, message: "session \(found.session) has \(found.token.tokenType.prefix(16))-bound tokens "
                                                + "(DPoP=yes), which need a proof at every request: use GetProof (tokenbroker ctl proof) instead of a credential helper"))
                }
                return .success(.found(found))
            }
            switch BrokerError(reply, session: request.session ?? "") {
            case .noSuchSession?, .permissionDenied?:
                // No session serves it for this user (or, by name, this user may not use it).
                return .success(.notFound)
            case let error?:
                return .failure(Ctl.failure(error, request))
            case nil:
                return .failure(Ctl.Failure(code: ExitCode.failure, message: "the broker answered \(name)"))
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

    // MARK: - git

    /// git's credential helper protocol (git-credential(1)): `get`, `store`, `erase`, with
    /// `key=value` lines on standard input up to a blank line.
    static func git(_ operands: [String], username: String, _ relay: Relay, _ output: inout some TextOutput,
                    _ errors: inout some TextOutput) -> Int32 {
        guard operands.count == 1, ["get", "store", "erase"].contains(operands[0]) else {
            errors.write("tokenbroker credential git: expected one action: get, store or erase\n")
            return ExitCode.usage
        }
        guard let input = text(relay.environment.standardInput()) else {
            errors.write("tokenbroker credential git: unreadable input (more than 64 KiB, not UTF-8, or not within 5 s)\n")
            return ExitCode.failure
        }
        var fields: [String: String] = [:]
        var capabilities: Set<String> = []
        for line in lines(input) {
            if line.isEmpty { break }
            guard let equals = line.firstIndex(of: "=") else { continue }
            let key = String(line[..<equals]), value = String(line[line.index(after: equals)...])
            if key == "capability[]" { capabilities.insert(value) } else { fields[key] = value }
        }
        // store: the broker keeps the session; nothing to keep here.
        guard operands[0] != "store" else { return ExitCode.ok }
        let url: String
        if let given = fields["url"] {
            url = given
        } else if let host = fields["host"], !host.isEmpty, !host.contains("@") {
            url = (fields["protocol"].map { $0 + "://" } ?? "") + host + (fields["path"].map { "/" + $0 } ?? "")
        } else {
            return ExitCode.ok   // nothing to look up: git asks its next helper
        }
        if operands[0] == "erase" {
            // The password git was refused with: if it is still the current token, the session
            // refreshes (once, for every process); if not, nothing happens.
            guard let rejected = fields["password"], !rejected.isEmpty else { return ExitCode.ok }
            if case let .failure(failure) = relay.lookup(url, rejected: rejected) { return fail("git", failure, &errors) }
            return ExitCode.ok
        }
        switch relay.lookup(url) {
        case let .success(.found(reply)):
            var answer = "username=\(username)\npassword=\(reply.token.token)\n"
            // (ephemeral: git must not hand the token to a storing helper, which would outlive a logout.)
            if capabilities.contains("authtype") { answer += "capability[]=authtype\nauthtype=Bearer\ncredential=\(reply.token.token)\nephemeral=true\n" }
            if let expiresAt = reply.token.expiresAt { answer += "password_expiry_utc=\(expiresAt)\n" }
            output.write(answer)
            return ExitCode.ok
        case .success(.notFound):
            return ExitCode.ok
        case let .failure(failure):
            return fail("git", failure, &errors)
        }
    }

    // MARK: - kubectl

    /// kubectl's exec credential plugin (client.authentication.k8s.io v1 and v1beta1): the URL
    /// from `--url`, else the cluster's server (`provideClusterInfo: true`); or `--session`.
    static func kubectl(_ operands: [String], url: String?, session: String?, _ relay: Relay, _ output: inout some TextOutput,
                        _ errors: inout some TextOutput) -> Int32 {
        guard operands.isEmpty else {
            errors.write("tokenbroker credential kubectl: takes no operand (kubectl sets KUBERNETES_EXEC_INFO)\n")
            return ExitCode.usage
        }
        var apiVersion = "client.authentication.k8s.io/v1beta1"
        var server: String?
        if let info = relay.environment.variable("KUBERNETES_EXEC_INFO") {
            // (Up to 1 MiB: a kubeconfig may embed a CA bundle in the cluster info.)
            guard info.utf8.count <= 1 << 20, case let .object(object)? = try? JSONParser.parse(ArraySlice(info.utf8)),
                  let version = object["apiVersion"]?.stringValue,
                  ["client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1"].contains(version) else {
                errors.write("tokenbroker credential kubectl: KUBERNETES_EXEC_INFO is not an ExecCredential of client.authentication.k8s.io/v1 or v1beta1\n")
                return ExitCode.failure
            }
            apiVersion = version
            server = object["spec"]?.objectValue?["cluster"]?.objectValue?["server"]?.stringValue
        }
        let found: Result<Lookup, Ctl.Failure>
        if let session {
            found = relay.session(session)
        } else if let target = url ?? server {
            found = relay.lookup(target)
        } else {
            errors.write("tokenbroker credential kubectl: needs --url URL or --session NAME (or provideClusterInfo: true in the kubeconfig)\n")
            return ExitCode.usage
        }
        switch found {
        case let .success(.found(reply)):
            var status: JSONObject = ["token": .string(reply.token.token)]
            if let expiresAt = reply.token.expiresAt { status["expirationTimestamp"] = .string(UTCTime.timestamp(expiresAt)) }
            output.write(JSON.object(["apiVersion": .string(apiVersion), "kind": "ExecCredential", "status": .object(status)]).text + "\n")
            return ExitCode.ok
        case .success(.notFound):
            errors.write("tokenbroker credential kubectl: no session this user may use serves \(url ?? server ?? session ?? "it")\n")
            return ExitCode.failure
        case let .failure(failure):
            return fail("kubectl", failure, &errors)
        }
    }

    // MARK: - docker, podman, skopeo, buildah

    /// The docker-credential-helpers protocol: `get` (the server URL on standard input) →
    /// `{ServerURL, Username, Secret}`; `store` and `erase` keep nothing (the broker owns the
    /// session; an erase carries no token to recover); `list` → `{}`.
    static func docker(_ operands: [String], username: String, _ relay: Relay, _ output: inout some TextOutput,
                       _ errors: inout some TextOutput) -> Int32 {
        guard operands.count == 1, ["get", "store", "erase", "list"].contains(operands[0]) else {
            output.write("tokenbroker credential docker: expected one action: get, store, erase or list\n")
            return ExitCode.failure
        }
        let input = text(relay.environment.standardInput())
        switch operands[0] {
        case "list":
            output.write("{}\n")
            return ExitCode.ok
        case "store", "erase":
            return ExitCode.ok
        default:
            break
        }
        guard let input else {
            output.write("unreadable input\n")
            return ExitCode.failure
        }
        // (On bytes: "\r\n" is one Character, which neither "\r" nor "\n" equals.)
        func isSpace(_ byte: UInt8) -> Bool { byte == 0x0A || byte == 0x0D || byte == 0x20 || byte == 0x09 }
        var trimmed = input.utf8[...]
        while let last = trimmed.last, isSpace(last) { trimmed = trimmed.dropLast() }
        while let first = trimmed.first, isSpace(first) { trimmed = trimmed.dropFirst() }
        let server = String(Substring(trimmed))
        guard !server.isEmpty else {
            output.write("no server URL given\n")
            return ExitCode.failure
        }
        // The protocol names no scheme: this tool's way to the registry decides it.
        let found = relay.environment.registries.requestURL(for: server).map { relay.lookup($0) } ?? .success(.notFound)
        switch found {
        case let .success(.found(reply)):
            output.write(JSON.object(["ServerURL": .string(server), "Username": .string(username),
                                      "Secret": .string(reply.token.token)]).text + "\n")
            return ExitCode.ok
        case .success(.notFound):
            // The exact words the docker client treats as "not found".
            output.write("credentials not found in native keychain\n")
            return ExitCode.failure
        case let .failure(failure):
            output.write("\(failure.message)\n")
            return ExitCode.failure
        }
    }

    // MARK: - Terraform, OpenTofu

    /// Terraform's credentials helper protocol: `get HOST` → `{"token": …}`, or `{}` when no
    /// session serves the host; `store HOST` and `forget HOST` keep nothing.
    static func terraform(_ operands: [String], _ relay: Relay, _ output: inout some TextOutput, _ errors: inout some TextOutput) -> Int32 {
        guard operands.count == 2, ["get", "store", "forget"].contains(operands[0]) else {
            errors.write("tokenbroker credential terraform: expected get, store or forget, and a host\n")
            return ExitCode.usage
        }
        guard operands[0] == "get" else {
            if operands[0] == "store" { _ = relay.environment.standardInput() }
            return ExitCode.ok
        }
        // Terraform finds a host's services over https only (its remote service discovery).
        let host = operands[1]
        switch relay.lookup(host.contains("://") ? host : "https://" + host) {
        case let .success(.found(reply)):
            output.write(JSON.object(["token": .string(reply.token.token)]).text + "\n")
            return ExitCode.ok
        case .success(.notFound):
            output.write("{}\n")
            return ExitCode.ok
        case let .failure(failure):
            return fail("terraform", failure, &errors)
        }
    }

    // MARK: - Bazel

    /// Bazel's credential helper protocol: `get` with `{"uri": …}` on standard input →
    /// `{"headers": {"Authorization": ["Bearer …"]}, "expires": RFC 3339}`, or `{}`.
    static func bazel(_ operands: [String], _ relay: Relay, _ output: inout some TextOutput, _ errors: inout some TextOutput) -> Int32 {
        guard operands == ["get"] else {
            errors.write("tokenbroker credential bazel: expected the action get\n")
            return ExitCode.usage
        }
        guard let input = text(relay.environment.standardInput()),
              case let .object(request)? = try? JSONParser.parse(ArraySlice(input.utf8)), let uri = request["uri"]?.stringValue else {
            errors.write("tokenbroker credential bazel: expected {\"uri\": \"…\"} on standard input\n")
            return ExitCode.failure
        }
        switch relay.lookup(uri) {
        case let .success(.found(reply)):
            var answer: JSONObject = ["headers": ["Authorization": .array([.string("Bearer " + reply.token.token)])]]
            if let expiresAt = reply.token.expiresAt { answer["expires"] = .string(UTCTime.timestamp(expiresAt)) }
            output.write(JSON.object(answer).text + "\n")
            return ExitCode.ok
        case .success(.notFound):
            output.write("{}\n")
            return ExitCode.ok
        case let .failure(failure):
            return fail("bazel", failure, &errors)
        }
    }

    private static func fail(_ protocolName: String, _ failure: Ctl.Failure, _ errors: inout some TextOutput) -> Int32 {
        errors.write("tokenbroker credential \(protocolName): \(failure.message)\n")
        return failure.code == ExitCode.ok ? ExitCode.failure : failure.code
    }
}
