import Basics
import BrokerContract
import Varlink

/// The credential-helper protocols, declared once: each one's name, the link a tool runs it by,
/// its usage line, and its plan — how it reads a tool's request (operands, options, standard
/// input, environment) into either an answer at once or one lookup at the broker, with its words
/// for the three outcomes (found, not found, failed). `CredentialHelper.run` makes the lookup;
/// the help text, `Command.helperNames` and the install links (a test checks the Makefile's)
/// follow from this table.
struct CredentialProtocol: Sendable {
    let name: String
    /// The name a tool runs it by (a link to `tokenbroker` the package installs), if any.
    let link: String?
    let usage: String
    let plan: @Sendable (Request) -> Plan

    /// What a tool asked.
    struct Request {
        var operands: [String]
        /// `--username`, `--url`, `--session` (as given; each protocol reads its own).
        var options: CredentialHelper.Options
        var environment: CredentialHelper.Environment

        var username: String { options["--username"] ?? "oauth2" }
    }

    /// What to write and exit with.
    struct Answer {
        var output = ""
        var errors = ""
        var code = ExitCode.ok

        static let nothing = Answer()
    }

    enum Query {
        /// The session that serves a URL; with `rejected`, the token a server refused (recovered
        /// once for every process).
        case url(String, rejected: String? = nil)
        /// A session by name.
        case session(String)
    }

    /// A protocol's words for the outcomes of its lookup.
    struct Replies {
        var found: (CredentialReply) -> Answer
        var notFound: Answer
        var failure: (Ctl.Failure) -> Answer
    }

    enum Plan {
        case done(Answer)
        case lookup(Query, Replies)
    }

    static let all: [CredentialProtocol] = [git, kubectl, docker, terraform, bazel]

    static func named(_ name: String) -> CredentialProtocol? { all.first { $0.name == name } }

    /// A failure on standard error, as most protocols report one.
    static func failure(_ protocolName: String) -> (Ctl.Failure) -> Answer {
        { failure in
            Answer(errors: "tokenbroker credential \(protocolName): \(failure.message)\n",
                   code: failure.code == ExitCode.ok ? ExitCode.failure : failure.code)
        }
    }

    static func usageError(_ protocolName: String, _ message: String, code: Int32 = ExitCode.usage) -> Plan {
        .done(Answer(errors: "tokenbroker credential \(protocolName): \(message)\n", code: code))
    }

    // MARK: - git

    /// git's credential helper protocol (git-credential(1)): `get`, `store`, `erase`, with
    /// `key=value` lines on standard input up to a blank line.
    static let git = CredentialProtocol(name: "git", link: "git-credential-tokenbroker",
                                        usage: "tokenbroker credential git [--username <name>] get|store|erase") { request in
        let operands = request.operands
        guard operands.count == 1, ["get", "store", "erase"].contains(operands[0]) else {
            return usageError("git", "expected one action: get, store or erase")
        }
        guard let input = CredentialHelper.text(request.environment.standardInput()) else {
            return usageError("git", "unreadable input (more than 64 KiB, not UTF-8, or not within 5 s)", code: ExitCode.failure)
        }
        var fields: [String: String] = [:]
        var capabilities: Set<String> = []
        for line in CredentialHelper.lines(input) {
            if line.isEmpty { break }
            guard let equals = line.firstIndex(of: "=") else { continue }
            let key = String(line[..<equals]), value = String(line[line.index(after: equals)...])
            if key == "capability[]" { capabilities.insert(value) } else { fields[key] = value }
        }
        // store: the broker keeps the session; nothing to keep here.
        guard operands[0] != "store" else { return .done(.nothing) }
        let url: String
        if let given = fields["url"] {
            url = given
        } else if let host = fields["host"], !host.isEmpty, !host.contains("@") {
            url = (fields["protocol"].map { $0 + "://" } ?? "") + host + (fields["path"].map { "/" + $0 } ?? "")
        } else {
            return .done(.nothing)   // nothing to look up: git asks its next helper
        }
        if operands[0] == "erase" {
            // The password git was refused with: if it is still the current token, the session
            // refreshes (once, for every process); if not, nothing happens.
            guard let rejected = fields["password"], !rejected.isEmpty else { return .done(.nothing) }
            return .lookup(.url(url, rejected: rejected), Replies(found: { _ in .nothing }, notFound: .nothing, failure: failure("git")))
        }
        let username = request.username
        return .lookup(.url(url), Replies(found: { reply in
            var answer = "username=\(username)\npassword=\(reply.token.token)\n"
            // (ephemeral: git must not hand the token to a storing helper, which would outlive a logout.)
            if capabilities.contains("authtype") { answer += "capability[]=authtype\nauthtype=Bearer\ncredential=\(reply.token.token)\nephemeral=true\n" }
            if let expiresAt = reply.token.expiresAt { answer += "password_expiry_utc=\(expiresAt)\n" }
            return Answer(output: answer)
        }, notFound: .nothing, failure: failure("git")))
    }

    // MARK: - kubectl

    /// kubectl's exec credential plugin (client.authentication.k8s.io v1 and v1beta1): the URL
    /// from `--url`, else the cluster's server (`provideClusterInfo: true`); or `--session`.
    static let kubectl = CredentialProtocol(name: "kubectl", link: nil,
                                            usage: "tokenbroker credential kubectl [--url <url> | --session <name>]") { request in
        guard request.operands.isEmpty else { return usageError("kubectl", "takes no operand (kubectl sets KUBERNETES_EXEC_INFO)") }
        var apiVersion = "client.authentication.k8s.io/v1beta1"
        var server: String?
        if let info = request.environment.variable("KUBERNETES_EXEC_INFO") {
            // (Up to 1 MiB: a kubeconfig may embed a CA bundle in the cluster info.)
            guard info.utf8.count <= 1 << 20, case let .object(object)? = try? JSONParser.parse(ArraySlice(info.utf8)),
                  let version = object["apiVersion"]?.stringValue,
                  ["client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1"].contains(version) else {
                return usageError("kubectl", "KUBERNETES_EXEC_INFO is not an ExecCredential of client.authentication.k8s.io/v1 or v1beta1",
                                  code: ExitCode.failure)
            }
            apiVersion = version
            server = object["spec"]?.objectValue?["cluster"]?.objectValue?["server"]?.stringValue
        }
        let url = request.options["--url"], session = request.options["--session"]
        let query: Query
        if let session {
            query = .session(session)
        } else if let target = url ?? server {
            query = .url(target)
        } else {
            return usageError("kubectl", "needs --url URL or --session NAME (or provideClusterInfo: true in the kubeconfig)")
        }
        let version = apiVersion
        return .lookup(query, Replies(found: { reply in
            var status: JSONObject = ["token": .string(reply.token.token)]
            if let expiresAt = reply.token.expiresAt { status["expirationTimestamp"] = .string(UTCTime.timestamp(expiresAt)) }
            return Answer(output: JSON.object(["apiVersion": .string(version), "kind": "ExecCredential", "status": .object(status)]).text + "\n")
        }, notFound: Answer(errors: "tokenbroker credential kubectl: no session this user may use serves \(url ?? server ?? session ?? "it")\n",
                            code: ExitCode.failure),
        failure: failure("kubectl")))
    }

    // MARK: - docker, podman, skopeo, buildah

    /// The docker-credential-helpers protocol: `get` (the server URL on standard input) →
    /// `{ServerURL, Username, Secret}`; `store` and `erase` keep nothing (the broker owns the
    /// session; an erase carries no token to recover); `list` → `{}`. Its errors go to standard
    /// output, which the docker client reads.
    static let docker = CredentialProtocol(name: "docker", link: "docker-credential-tokenbroker",
                                           usage: "tokenbroker credential docker [--username <name>] get|store|erase|list") { request in
        let operands = request.operands
        guard operands.count == 1, ["get", "store", "erase", "list"].contains(operands[0]) else {
            return .done(Answer(output: "tokenbroker credential docker: expected one action: get, store, erase or list\n", code: ExitCode.failure))
        }
        let input = CredentialHelper.text(request.environment.standardInput())
        switch operands[0] {
        case "list": return .done(Answer(output: "{}\n"))
        case "store", "erase": return .done(.nothing)
        default: break
        }
        guard let input else { return .done(Answer(output: "unreadable input\n", code: ExitCode.failure)) }
        // (On bytes: "\r\n" is one Character, which neither "\r" nor "\n" equals.)
        func isSpace(_ byte: UInt8) -> Bool { byte == 0x0A || byte == 0x0D || byte == 0x20 || byte == 0x09 }
        var trimmed = input.utf8[...]
        while let last = trimmed.last, isSpace(last) { trimmed = trimmed.dropLast() }
        while let first = trimmed.first, isSpace(first) { trimmed = trimmed.dropFirst() }
        let server = String(Substring(trimmed))
        guard !server.isEmpty else { return .done(Answer(output: "no server URL given\n", code: ExitCode.failure)) }
        // The exact words the docker client treats as "not found".
        let notFound = Answer(output: "credentials not found in native keychain\n", code: ExitCode.failure)
        // The protocol names no scheme: this tool's way to the registry decides it.
        guard let url = request.environment.registries.requestURL(for: server) else { return .done(notFound) }
        let username = request.username
        return .lookup(.url(url), Replies(found: { reply in
            Answer(output: JSON.object(["ServerURL": .string(server), "Username": .string(username), "Secret": .string(reply.token.token)]).text + "\n")
        }, notFound: notFound, failure: { failure in Answer(output: "\(failure.message)\n", code: ExitCode.failure) }))
    }

    // MARK: - Terraform, OpenTofu

    /// Terraform's credentials helper protocol: `get HOST` → `{"token": …}`, or `{}` when no
    /// session serves the host; `store HOST` and `forget HOST` keep nothing.
    static let terraform = CredentialProtocol(name: "terraform", link: "terraform-credentials-tokenbroker",
                                              usage: "tokenbroker credential terraform get|store|forget <host>") { request in
        let operands = request.operands
        guard operands.count == 2, ["get", "store", "forget"].contains(operands[0]) else {
            return usageError("terraform", "expected get, store or forget, and a host")
        }
        guard operands[0] == "get" else {
            if operands[0] == "store" { _ = request.environment.standardInput() }
            return .done(.nothing)
        }
        // Terraform finds a host's services over https only (its remote service discovery).
        let host = operands[1]
        return .lookup(.url(CredentialHelper.hasScheme(host) ? host : "https://" + host), Replies(found: { reply in
            Answer(output: JSON.object(["token": .string(reply.token.token)]).text + "\n")
        }, notFound: Answer(output: "{}\n"), failure: failure("terraform")))
    }

    // MARK: - Bazel

    /// Bazel's credential helper protocol: `get` with `{"uri": …}` on standard input →
    /// `{"headers": {"Authorization": ["Bearer …"]}, "expires": RFC 3339}`, or `{}`.
    static let bazel = CredentialProtocol(name: "bazel", link: "bazel-credential-tokenbroker", usage: "tokenbroker credential bazel get") { request in
        guard request.operands == ["get"] else { return usageError("bazel", "expected the action get") }
        guard let input = CredentialHelper.text(request.environment.standardInput()),
              case let .object(asked)? = try? JSONParser.parse(ArraySlice(input.utf8)), let uri = asked["uri"]?.stringValue else {
            return usageError("bazel", "expected {\"uri\": \"…\"} on standard input", code: ExitCode.failure)
        }
        return .lookup(.url(uri), Replies(found: { reply in
            var answer: JSONObject = ["headers": ["Authorization": .array([.string("Bearer " + reply.token.token)])]]
            if let expiresAt = reply.token.expiresAt { answer["expires"] = .string(UTCTime.timestamp(expiresAt)) }
            return Answer(output: JSON.object(answer).text + "\n")
        }, notFound: Answer(output: "{}\n"), failure: failure("bazel")))
    }
}
