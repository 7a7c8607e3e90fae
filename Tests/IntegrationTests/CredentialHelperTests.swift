import DevIssuer
import Foundation
#if canImport(Glibc)
import Glibc
#endif
import Testing
import TestSupport
import Varlink
import HTTPTransport

/// `tokenbroker credential …`: each tool's helper protocol against the real daemon, and the
/// real git and kubectl against loopback servers that accept only a live access token.
@Suite("Credential helpers", .serialized)
struct CredentialHelperTests {
    static let config = """
        [Broker]
        SocketMode=0666

        [Session]
        Name=repos
        Upstream=test
        AllowUsers=\(Broker.workerUID)
        Serves=https://git.example.test/org registry.example.test app.terraform.test 127.0.0.1:6443

        [Session]
        Name=private
        Upstream=test
        Serves=https://git.example.test/org/private

        """

    /// Runs `tokenbroker <arguments>` (or the helper link `name`) with `stdin`, optionally as the worker.
    static func helper(_ broker: Broker, _ arguments: [String], stdin: String = "", as name: String? = nil, worker: Bool = false,
                       environment: [String: String] = [:]) async throws -> (code: Int32, out: String, err: String) {
        var executable = Paths.tokenbroker
        if let name {
            let link = broker.directory + "/" + name
            if !FileManager.default.fileExists(atPath: link) { try FileManager.default.createSymbolicLink(atPath: link, withDestinationPath: executable) }
            executable = link
        }
        var argv = arguments
        if worker {
            let copy = broker.directory + "/tokenbroker-worker"
            if !FileManager.default.fileExists(atPath: copy) {
                try FileManager.default.copyItem(atPath: Paths.tokenbroker, toPath: copy)
                chmod(copy, 0o755)
            }
            argv = ["--reuid=\(Broker.workerUID)", "--regid=\(Broker.workerUID)", "--clear-groups", copy] + arguments
            executable = "/usr/bin/setpriv"
        }
        var env = ProcessInfo.processInfo.environment
        env["TOKENBROKER_SOCKET"] = broker.socket
        env.merge(environment) { $1 }
        let run = try Child(executable, argv, environment: env, directory: broker.directory, stdin: stdin)
        let code = await run.wait()
        return (code, run.stdout, run.stderr)
    }

    static func token(_ broker: Broker, _ session: String) throws -> String {
        try #require(broker.call("GetToken", ["session": .string(session)]).parameters["token"]?.stringValue)
    }

    @Test("Credential answers alike where few sessions serve the URL's host (on the I/O thread) and where more do than it looks through there (in a task)")
    func manyServingOneHost() async throws {
        // 20 sessions serve one host, more than BrokerService.inlineCandidates (16); 2 another.
        var config = "[Broker]\nSocketMode=0666\n"
        for i in 0..<20 { config += "\n[Session]\nName=many\(i)\nUpstream=test\nServes=https://many.example.test/p\(i)\n" }
        config += "\n[Session]\nName=few0\nUpstream=test\nServes=https://few.example.test/\n"
        config += "\n[Session]\nName=few1\nUpstream=test\nServes=https://few.example.test/deep\n"
        try await withBroker(config: config) { broker in
            for (url, session) in [("https://many.example.test/p7/x", "many7"), ("https://many.example.test/p19", "many19"),
                                   ("https://few.example.test/deep/x", "few1"), ("https://few.example.test/x", "few0")] {
                let reply = try broker.call("Credential", ["url": .string(url)])
                let token = try Self.token(broker, session)
                #expect(reply.parameters["session"]?.stringValue == session && fp(reply.parameters["token"]) == fp(token), "\(url)")
            }
            #expect(try broker.call("Credential", ["url": "https://many.example.test/q"]).error == "io.tokenbroker.Broker.NoSuchSession")
            #expect(try broker.call("Credential", ["url": "https://few.example.test.evil/"]).error == "io.tokenbroker.Broker.NoSuchSession")
            #expect(try broker.call("Credential", ["url": "https://few.example.test/x", "resource": "https://r.example/"]).error
                    == "org.varlink.service.InvalidParameter")
        }
    }

    @Test("each protocol answers with the session that serves the URL for this user, its not-found otherwise, never a token elsewhere")
    func protocols() async throws {
        try await withBroker(config: Self.config) { broker in
            let repos = try Self.token(broker, "repos"), privateToken = try Self.token(broker, "private")
            // git: the longest match among the sessions the caller may use.
            let get = "protocol=https\nhost=git.example.test\npath=org/private/x.git\n\n"
            let asRoot = try await Self.helper(broker, ["credential", "git", "get"], stdin: get)
            // (Compared here, not inside #expect: a failure must not print a token.)
            let check1 = asRoot.code == 0 && asRoot.out.hasPrefix("username=oauth2\npassword=\(privateToken)\npassword_expiry_utc=")
            #expect(check1, "\(fp(asRoot.out))")
            let asWorker = try await Self.helper(broker, ["credential", "git", "--username", "x-access-token", "get"], stdin: get, worker: true)
            let check2 = asWorker.code == 0 && asWorker.out.hasPrefix("username=x-access-token\npassword=\(repos)\n")
            #expect(check2, "\(fp(asWorker.out)) \(asWorker.err)")
            let authtype = try await Self.helper(broker, ["credential", "git", "get"],
                                                 stdin: "capability[]=authtype\nprotocol=https\nhost=git.example.test\npath=org/a\n\n")
            let check3 = authtype.out.contains("authtype=Bearer\ncredential=\(repos)\n")
            #expect(check3)
            // Nobody serves it: git asks its next helper.
            let none = try await Self.helper(broker, ["credential", "git", "get"], stdin: "protocol=https\nhost=elsewhere.test\n\n")
            let check101 = none.code == 0 && none.out.isEmpty
            #expect(check101)
            // A bare entry means https: a plain-http URL to the same host gets nothing (the token
            // would cross the network in clear), on any port; nor does a host with a user part.
            for stdin in ["protocol=http\nhost=git.example.test:9999\npath=org/a\n\n", "protocol=https\nhost=evil.test@git.example.test\n\n"] {
                let plain = try await Self.helper(broker, ["credential", "git", "get"], stdin: stdin)
                let empty = plain.code == 0 && plain.out.isEmpty
                #expect(empty)
            }
            let httpBazel = try await Self.helper(broker, ["credential", "bazel", "get"], stdin: #"{"uri":"http://registry.example.test:8080/a"}"#)
            let noHeader = httpBazel.code == 0 && httpBazel.out == "{}\n"
            #expect(noHeader)
            // A URL too long for the broker falls through to the tool's next helper.
            let long = try await Self.helper(broker, ["get", "registry.example.test/" + String(repeating: "a", count: 3000)], as: "terraform-credentials-tokenbroker")
            let fallsThrough = long.code == 0 && long.out == "{}\n"
            #expect(fallsThrough)
            let worst = try await Self.helper(broker, ["credential", "git", "get"], stdin: String(repeating: "x", count: 70_000))
            let check4 = worst.code != 0 && worst.out.isEmpty && !worst.err.contains(repos)
            #expect(check4)
            #expect(try await Self.helper(broker, ["credential", "git", "store"], stdin: "host=git.example.test\npassword=p\n\n").code == 0)
            let unknown = try await Self.helper(broker, ["credential", "git", "frobnicate"])
            let check102 = unknown.code == 64 && unknown.out.isEmpty
            #expect(check102)

            // docker-credential-tokenbroker, as docker runs it.
            let docker = try await Self.helper(broker, ["get"], stdin: "registry.example.test\n", as: "docker-credential-tokenbroker")
            let check5 = docker.code == 0 && docker.out == #"{"ServerURL":"registry.example.test","Username":"oauth2","Secret":"\#(repos)"}"# + "\n"
            #expect(check5, "\(fp(docker.out)) \(docker.err)")
            // Windows-style input (one Character in Swift, "\r\n") is trimmed like any line end.
            let crlf = try await Self.helper(broker, ["get"], stdin: "registry.example.test\r\n", as: "docker-credential-tokenbroker")
            let check5a = crlf.code == 0 && crlf.out == #"{"ServerURL":"registry.example.test","Username":"oauth2","Secret":"\#(repos)"}"# + "\n"
            #expect(check5a, "\(fp(crlf.out)) \(crlf.err)")
            // A registry the tool may reach in clear gets no https entry's token: loopback (docker's
            // engine takes it as insecure), registries.conf marking it insecure, the tool started
            // with --tls-verify=false.
            let work = broker.directory + "/xdg"
            try FileManager.default.createDirectory(atPath: work + "/containers", withIntermediateDirectories: true)
            try "[[registry]]\nlocation = \"registry.example.test\"\ninsecure = true\n".write(toFile: work + "/containers/registries.conf", atomically: true, encoding: .utf8)
            let loopback = try await Self.helper(broker, ["get"], stdin: "127.0.0.1:6443\n", as: "docker-credential-tokenbroker")
            let configured = try await Self.helper(broker, ["get"], stdin: "registry.example.test\n", as: "docker-credential-tokenbroker",
                                                   environment: ["XDG_CONFIG_HOME": work])
            let link = broker.directory + "/docker-credential-tokenbroker"
            let flagged = try Child("/usr/bin/python3", ["-c", "import subprocess, sys; sys.exit(subprocess.run(sys.argv[1:3]).returncode)", link, "get", "--tls-verify=false"],
                                    environment: ProcessInfo.processInfo.environment.merging(["TOKENBROKER_SOCKET": broker.socket]) { $1 },
                                    directory: broker.directory, stdin: "registry.example.test\n")
            let flaggedCode = await flagged.wait()
            for (answer, code) in [(loopback.out, loopback.code), (configured.out, configured.code), (flagged.stdout, flaggedCode)] {
                let notFound = code == 1 && answer == "credentials not found in native keychain\n"
                #expect(notFound, "\(fp(answer))")
            }
            let missing = try await Self.helper(broker, ["get"], stdin: "other.test\n", as: "docker-credential-tokenbroker")
            let check103 = missing.code == 1 && missing.out == "credentials not found in native keychain\n"
            #expect(check103)
            let check104 = try await Self.helper(broker, ["list"], as: "docker-credential-tokenbroker").out == "{}\n"
            #expect(check104)

            // Terraform and Bazel.
            let terraform = try await Self.helper(broker, ["get", "app.terraform.test"], as: "terraform-credentials-tokenbroker")
            let check6 = terraform.code == 0 && terraform.out == #"{"token":"\#(repos)"}"# + "\n"
            #expect(check6)
            let check105 = try await Self.helper(broker, ["get", "nobody.test"], as: "terraform-credentials-tokenbroker").out == "{}\n"
            #expect(check105)
            let bazel = try await Self.helper(broker, ["credential", "bazel", "get"], stdin: #"{"uri":"https://git.example.test/org/a"}"#)
            let check7 = bazel.code == 0 && bazel.out.hasPrefix(#"{"headers":{"Authorization":["Bearer \#(repos)"]},"expires":""#)
            #expect(check7)
            let badBazel = try await Self.helper(broker, ["credential", "bazel", "get"], stdin: "{uri")
            let check106 = badBazel.code == 1 && badBazel.out.isEmpty
            #expect(check106)

            // kubectl's exec plugin, both API versions.
            for version in ["client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1"] {
                let info = #"{"apiVersion":"\#(version)","kind":"ExecCredential","spec":{"cluster":{"server":"https://127.0.0.1:6443"},"interactive":false}}"#
                let kube = try await Self.helper(broker, ["credential", "kubectl"], environment: ["KUBERNETES_EXEC_INFO": info])
                let check8 = kube.code == 0 && kube.out.hasPrefix(#"{"apiVersion":"\#(version)","kind":"ExecCredential","status":{"token":"\#(repos)","expirationTimestamp":""#)
                #expect(check8, "\(fp(kube.out)) \(kube.err)")
            }
            let badInfo = try await Self.helper(broker, ["credential", "kubectl", "--url", "https://127.0.0.1:6443"],
                                                environment: ["KUBERNETES_EXEC_INFO": #"{"apiVersion":"v0"}"#])
            let check107 = badInfo.code == 1 && badInfo.out.isEmpty
            #expect(check107)
            // A worker asking for what only root's session serves learns nothing of it.
            let probe = try await Self.helper(broker, ["credential", "kubectl", "--url", "https://git.example.test/org/private"], worker: true)
            let check9 = probe.out.contains(repos) && !probe.out.contains(privateToken)
            #expect(check9)
            let stranger = try await Self.helper(broker, ["credential", "kubectl", "--url", "https://nobody.test"], worker: true)
            let check108 = stranger.code == 1 && stranger.out.isEmpty && stranger.err.contains("no session this user may use serves")
            #expect(check108)
        }
    }
}

/// git's smart HTTP on loopback: `git http-backend` (CGI) behind a server that accepts a
/// request only with a live access token of the issuer as its Basic password.
final class GitHTTPServer: Sendable {
    let root: String
    private let listener: LoopbackListener
    let refused = Locked(0)
    var port: Int { listener.port }

    init(root: String, accepts: @escaping @Sendable (String) -> Bool) throws {
        self.root = root
        let refused = self.refused
        listener = try LoopbackListener { fd in
            defer { close(fd) }
            guard let request = GitHTTPServer.read(fd) else { return }
            let answer: [UInt8]
            if let password = request.password, accepts(password) {
                answer = GitHTTPServer.backend(request, root: root)
            } else {
                refused.withLock { $0 += 1 }
                answer = Array("HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Basic realm=\"git\"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".utf8)
            }
            var sent = 0
            while sent < answer.count {
                let n = answer[sent...].withUnsafeBytes { write(fd, $0.baseAddress, $0.count) }
                if n <= 0 { return }
                sent += n
            }
        }
    }

    func stop() { listener.stop() }

    struct Request {
        var method: String
        var path: String
        var query: String
        var headers: [String: String]
        var body: [UInt8]

        /// The Basic password (a test's own server: the value is compared, never printed).
        var password: String? {
            guard let value = headers["authorization"], value.hasPrefix("Basic "),
                  let decoded = Data(base64Encoded: String(value.dropFirst(6))), let text = String(data: decoded, encoding: .utf8),
                  let colon = text.firstIndex(of: ":") else { return nil }
            return String(text[text.index(after: colon)...])
        }
    }

    /// One request, bytes throughout (pack data is binary); chunked bodies are joined.
    static func read(_ fd: Int32) -> Request? {
        var bytes: [UInt8] = []
        var buffer = [UInt8](repeating: 0, count: 65_536)
        func fill() -> Bool {
            let n = Glibc.read(fd, &buffer, buffer.count)
            guard n > 0 else { return false }
            bytes += buffer[..<n]
            return true
        }
        var headEnd: Int?
        while headEnd == nil {
            guard fill(), bytes.count < 1 << 20 else { return nil }
            headEnd = bytes.indices.dropLast(3).first { bytes[$0] == 13 && bytes[$0 + 1] == 10 && bytes[$0 + 2] == 13 && bytes[$0 + 3] == 10 }
        }
        let head = String(decoding: bytes[..<headEnd!], as: UTF8.self).split(separator: "\r\n")
        let requestLine = head.first?.split(separator: " ") ?? []
        guard requestLine.count >= 2 else { return nil }
        var headers: [String: String] = [:]
        for line in head.dropFirst() {
            guard let colon = line.firstIndex(of: ":") else { continue }
            headers[line[..<colon].lowercased()] = line[line.index(after: colon)...].trimmingCharacters(in: .whitespaces)
        }
        var body = Array(bytes[(headEnd! + 4)...])
        if headers["transfer-encoding"]?.lowercased() == "chunked" {
            var decoded: [UInt8] = []
            var offset = 0
            while true {
                while !body[offset...].starts(with: [13, 10]), body[offset...].firstIndex(of: 10) == nil {
                    guard fill() else { return nil }
                    body = Array(bytes[(headEnd! + 4)...])
                }
                guard let lineEnd = body[offset...].firstIndex(of: 10) else { return nil }
                let sizeText = String(decoding: body[offset..<lineEnd], as: UTF8.self).trimmingCharacters(in: .whitespacesAndNewlines)
                guard let size = Int(sizeText.split(separator: ";").first ?? "", radix: 16) else { return nil }
                let start = lineEnd + 1
                while body.count < start + size + 2 {
                    guard fill() else { return nil }
                    body = Array(bytes[(headEnd! + 4)...])
                }
                if size == 0 { break }
                decoded += body[start..<(start + size)]
                offset = start + size + 2
            }
            body = decoded
        } else {
            let length = Int(headers["content-length"] ?? "0") ?? 0
            while body.count < length {
                guard fill() else { return nil }
                body = Array(bytes[(headEnd! + 4)...])
            }
        }
        let target = String(requestLine[1])
        let question = target.firstIndex(of: "?")
        return Request(method: String(requestLine[0]), path: String(target[..<(question ?? target.endIndex)]),
                       query: question.map { String(target[target.index(after: $0)...]) } ?? "", headers: headers, body: body)
    }

    /// The request through `git http-backend`, its CGI answer as an HTTP response.
    static func backend(_ request: Request, root: String) -> [UInt8] {
        let process = Process()
        process.executableURL = URL(fileURLWithPath: "/usr/lib/git-core/git-http-backend")
        var environment = ["GIT_PROJECT_ROOT": root, "GIT_HTTP_EXPORT_ALL": "1", "REQUEST_METHOD": request.method, "PATH_INFO": request.path,
                           "QUERY_STRING": request.query, "CONTENT_TYPE": request.headers["content-type"] ?? "",
                           "CONTENT_LENGTH": String(request.body.count), "REMOTE_USER": "oauth2", "REMOTE_ADDR": "127.0.0.1",
                           "PATH": "/usr/bin:/bin"]
        if let protocolHeader = request.headers["git-protocol"] { environment["GIT_PROTOCOL"] = protocolHeader }
        process.environment = environment
        let input = Pipe(), output = Pipe()
        process.standardInput = input
        process.standardOutput = output
        process.standardError = FileHandle.nullDevice
        do { try process.run() } catch { return Array("HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n\r\n".utf8) }
        let body = Data(request.body)
        let writer = Thread {
            input.fileHandleForWriting.write(body)
            try? input.fileHandleForWriting.close()
        }
        writer.start()
        let answer = [UInt8](output.fileHandleForReading.readDataToEndOfFile())
        process.waitUntilExit()
        guard let split = answer.indices.dropLast(3).first(where: { answer[$0] == 13 && answer[$0 + 1] == 10 && answer[$0 + 2] == 13 && answer[$0 + 3] == 10 })
                ?? answer.indices.dropLast(1).first(where: { answer[$0] == 10 && answer[$0 + 1] == 10 }).map({ $0 - 2 }) else {
            return Array("HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n".utf8)
        }
        let headerBytes = answer[..<max(split, 0)]
        let bodyStart = answer[split] == 13 ? split + 4 : split + 4
        var status = "200 OK"
        var headers: [String] = []
        for line in String(decoding: headerBytes, as: UTF8.self).split(whereSeparator: { $0 == "\n" || $0 == "\r\n" }) {
            let line = line.trimmingCharacters(in: .whitespacesAndNewlines)
            if line.lowercased().hasPrefix("status:") { status = line.dropFirst(7).trimmingCharacters(in: .whitespaces) } else if !line.isEmpty { headers.append(line) }
        }
        let content = answer[min(bodyStart, answer.count)...]
        var response = Array("HTTP/1.1 \(status)\r\n".utf8)
        for header in headers { response += Array((header + "\r\n").utf8) }
        response += Array("Content-Length: \(content.count)\r\nConnection: close\r\n\r\n".utf8)
        return response + content
    }
}

extension CredentialHelperTests {
    /// Runs git with the broker as its only credential helper, in a home of its own.
    static func git(_ arguments: [String], in directory: String, broker: Broker, home: String) async throws -> (code: Int32, err: String) {
        var environment = ProcessInfo.processInfo.environment
        environment["HOME"] = home
        environment["GIT_CONFIG_NOSYSTEM"] = "1"
        environment["GIT_TERMINAL_PROMPT"] = "0"
        environment["TOKENBROKER_SOCKET"] = broker.socket
        environment["GIT_ASKPASS"] = "/bin/false"
        let run = try Child("/usr/bin/git", ["-c", "credential.helper=", "-c", "credential.helper=\(Paths.tokenbroker) credential git",
                                             "-c", "user.name=t", "-c", "user.email=t@example.test"] + arguments,
                            environment: environment, directory: directory)
        let code = await run.wait(timeout: 120)
        return (code, run.stderr)
    }

    @Test("real git: clone, push and fetch over smart HTTP with the broker's token; a rejected token is erased, recovered with one refresh, and the next fetch works; 16 parallel fetches after an expiry cost one refresh")
    func realGit() async throws {
        var options = DevIssuer.Options()
        options.accessTokenLifetime = .seconds(3600)
        let issuer = try DevIssuer(options: options)
        defer { issuer.stop() }
        let directory = try Paths.temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: directory) }
        let root = directory + "/repos", home = directory + "/home"
        for path in [root, home] { try FileManager.default.createDirectory(atPath: path, withIntermediateDirectories: true) }
        let setup = try Child("/usr/bin/git", ["init", "--bare", "-q", root + "/project.git"], directory: directory)
        #expect(await setup.wait() == 0)
        let server = try GitHTTPServer(root: root) { issuer.isValidAccessToken($0) }
        defer { server.stop() }
        let url = "http://127.0.0.1:\(server.port)/project.git"
        let config = Broker.oauthSession(issuer.tokenEndpoint, name: "git") + "RefreshAhead=0\nServes=http://127.0.0.1:\(server.port)/\n"
        let broker = try await Broker(config: "[Broker]\nSocketMode=0666\n\n" + config)
        defer { try? FileManager.default.removeItem(atPath: broker.directory) }
        #expect(try broker.call("Login", ["session": "git", "refreshToken": .string(issuer.issueRefreshToken())]).error == nil)

        // Clone (empty), commit, push, clone again.
        var result = try await Self.git(["clone", "-q", url, directory + "/work"], in: directory, broker: broker, home: home)
        #expect(result.code == 0, "clone: \(result.err)")
        try "hello\n".write(toFile: directory + "/work/README", atomically: true, encoding: .utf8)
        result = try await Self.git(["-C", directory + "/work", "add", "README"], in: directory, broker: broker, home: home)
        result = try await Self.git(["-C", directory + "/work", "commit", "-q", "-m", "first"], in: directory, broker: broker, home: home)
        #expect(result.code == 0, "commit: \(result.err)")
        result = try await Self.git(["-C", directory + "/work", "push", "-q", "origin", "HEAD:main"], in: directory, broker: broker, home: home)
        #expect(result.code == 0, "push: \(result.err)")
        result = try await Self.git(["clone", "-q", "-b", "main", url, directory + "/copy"], in: directory, broker: broker, home: home)
        #expect(result.code == 0 && FileManager.default.fileExists(atPath: directory + "/copy/README"), "second clone: \(result.err)")

        // The issuer revokes the token: the fetch fails, git erases it, the broker refreshes once.
        let before = issuer.counters.refreshGrants
        let current = try Self.token(broker, "git")
        issuer.revokeAccessToken(current)
        result = try await Self.git(["-C", directory + "/copy", "fetch", "-q"], in: directory, broker: broker, home: home)
        #expect(result.code != 0, "a fetch with a revoked token must fail")
        #expect(issuer.counters.refreshGrants == before + 1, "git's erase recovers with one refresh")
        result = try await Self.git(["-C", directory + "/copy", "fetch", "-q"], in: directory, broker: broker, home: home)
        #expect(result.code == 0, "the next fetch works: \(result.err)")
        #expect(issuer.counters.refreshGrants == before + 1)

        // 16 fetches at once after the token is refused: one refresh for all of them.
        let refused = try Self.token(broker, "git")
        issuer.revokeAccessToken(refused)
        let second = issuer.counters.refreshGrants
        let codes = try await withThrowingTaskGroup(of: Int32.self) { group in
            for _ in 0..<16 {
                group.addTask { try await Self.git(["-C", directory + "/copy", "fetch", "-q"], in: directory, broker: broker, home: home).code }
            }
            return try await group.reduce(into: []) { $0.append($1) }
        }
        #expect(codes.count == 16)
        #expect(issuer.counters.refreshGrants == second + 1, "16 erases of one refused token cost one refresh, not \(issuer.counters.refreshGrants - second)")
        result = try await Self.git(["-C", directory + "/copy", "fetch", "-q"], in: directory, broker: broker, home: home)
        #expect(result.code == 0, "after the refresh, fetches work: \(result.err)")
        _ = await broker.stop()
    }
}

extension CredentialHelperTests {
    /// A development issuer whose access tokens live 3 s.
    /// `lifetime`: long enough for what runs on one token (64 kubectl processes on two cores
    /// take several seconds: a token that expires among them costs a second refresh).
    static func shortLivedIssuer(lifetime: Duration = .seconds(3)) throws -> DevIssuer {
        var options = DevIssuer.Options()
        options.accessTokenLifetime = lifetime
        return try DevIssuer(options: options)
    }

    /// Returns once the session's token has expired (a session with `RefreshAhead=0` then
    /// refreshes only on the next demand); at most 20 s.
    static func waitUntilExpired(_ broker: Broker, _ session: String) async throws {
        let expiresAt = try #require(try broker.status(session)?["expiresAt"]?.intValue)
        let deadline = ContinuousClock.now + .seconds(20)
        while Int64(Date().timeIntervalSince1970) <= expiresAt {
            try #require(ContinuousClock.now < deadline, "the token of \(session) did not expire")
            try await Task.sleep(for: .milliseconds(100))
        }
    }

    static var kubectl: String? {
        ["/usr/bin/kubectl", "/usr/local/bin/kubectl"].first { FileManager.default.isExecutableFile(atPath: $0) }
    }

    @Test("real kubectl: its exec plugin gets the broker's token, and 64 parallel kubectl runs after the token expired cost one refresh",
          .enabled(if: CredentialHelperTests.kubectl != nil, "no kubectl here (Debian: kubernetes-client)"))
    func realKubectl() async throws {
        let kubectl = try #require(Self.kubectl)
        let issuer = try Self.shortLivedIssuer(lifetime: .seconds(15))
        defer { issuer.stop() }
        // The API server, on TLS (client-go sends an exec plugin's token over TLS only): pods
        // for a bearer token the issuer's protected resource accepts, 401 otherwise.
        let certificates = try await TestCertificates.make()
        defer { try? FileManager.default.removeItem(atPath: certificates) }
        let script = certificates + "/kube_api.py"
        try Self.kubeAPIScript.write(toFile: script, atomically: true, encoding: .utf8)
        let api = Process()
        api.executableURL = URL(fileURLWithPath: "/usr/bin/python3")
        api.arguments = [script, issuer.resourceURL, certificates]
        api.standardOutput = FileHandle.nullDevice
        api.standardError = FileHandle.nullDevice
        try api.run()
        // SIGKILL: the test process may hand its children a blocked SIGTERM.
        defer {
            kill(api.processIdentifier, SIGKILL)
            api.waitUntilExit()
        }
        // Its port, in a file it writes when it listens (a read of a pipe can come back empty
        // when a child's exit interrupts it).
        let portFile = certificates + "/port"
        try await eventually("the API server listens", timeout: .seconds(30)) { FileManager.default.fileExists(atPath: portFile) }
        let portLine = try String(contentsOfFile: portFile, encoding: .utf8)
        let port = try #require(Int(portLine.trimmingCharacters(in: .whitespacesAndNewlines)), "the API server did not start")
        let server = "https://127.0.0.1:\(port)"
        let broker = try await Broker(config: "[Broker]\nSocketMode=0666\n\n" + Broker.oauthSession(issuer.tokenEndpoint, name: "cluster")
                                      + "RefreshAhead=0\nServes=\(server)\n")
        defer { try? FileManager.default.removeItem(atPath: broker.directory) }
        #expect(try broker.call("Login", ["session": "cluster", "refreshToken": .string(issuer.issueRefreshToken())]).error == nil)
        let kubeconfig = broker.directory + "/kubeconfig"
        try """
            apiVersion: v1
            kind: Config
            clusters:
            - name: test
              cluster:
                server: \(server)
                certificate-authority: \(certificates)/ca.pem
            contexts:
            - name: test
              context: {cluster: test, user: broker}
            current-context: test
            users:
            - name: broker
              user:
                exec:
                  apiVersion: client.authentication.k8s.io/v1beta1
                  command: \(Paths.tokenbroker)
                  args: [credential, kubectl, --url, "\(server)"]
                  env: [{name: TOKENBROKER_SOCKET, value: "\(broker.socket)"}]
                  interactiveMode: Never

            """.write(toFile: kubeconfig, atomically: true, encoding: .utf8)
        func run() async throws -> (code: Int32, out: String, err: String) {
            var environment = ProcessInfo.processInfo.environment
            environment["HOME"] = broker.directory
            environment["KUBECONFIG"] = kubeconfig
            let child = try Child(kubectl, ["get", "--raw", "/api/v1/namespaces/default/pods"], environment: environment, directory: broker.directory)
            let code = await child.wait(timeout: 120)
            return (code, child.stdout, child.stderr)
        }
        let first = try await run()
        let check109 = first.code == 0 && first.out.contains("PodList")
        #expect(check109, "kubectl: \(first.err)")
        let served = issuer.counters.resourceRequests
        #expect(served >= 1, "the API server asked the issuer about the token")

        try await Self.waitUntilExpired(broker, "cluster")
        let before = issuer.counters.refreshGrants
        let runs = try await withThrowingTaskGroup(of: Int32.self) { group in
            for _ in 0..<64 { group.addTask { try await run().code } }
            return try await group.reduce(into: []) { $0.append($1) }
        }
        #expect(runs.count == 64 && runs.allSatisfy { $0 == 0 }, "kubectl runs failed: \(runs.filter { $0 != 0 }.count)")
        #expect(issuer.counters.refreshGrants == before + 1, "64 kubectl runs after the expiry cost \(issuer.counters.refreshGrants - before) refreshes")
        _ = await broker.stop()
    }

    /// A Kubernetes API endpoint on TLS for one resource: the pods of `default`, for a bearer
    /// token the issuer's protected resource (argv[1]) accepts. It writes its port to
    /// `argv[2]/port` once it listens.
    static let kubeAPIScript = #"""
        import http.server, socketserver, ssl, sys, urllib.request, urllib.error
        resource, certificates = sys.argv[1], sys.argv[2]
        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            def do_GET(self):
                authorization = self.headers.get("Authorization", "")
                ok = False
                if authorization.startswith("Bearer ") and self.path == "/api/v1/namespaces/default/pods":
                    try:
                        ok = urllib.request.urlopen(urllib.request.Request(resource, headers={"Authorization": authorization}), timeout=10).status == 200
                    except urllib.error.URLError:
                        ok = False
                body = (b'{"kind":"PodList","apiVersion":"v1","metadata":{"resourceVersion":"1"},"items":[]}' if ok else
                        b'{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"Unauthorized","code":401}')
                self.send_response(200 if ok else 401)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            def log_message(self, *arguments):
                pass
        class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
            daemon_threads = True
        server = Server(("127.0.0.1", 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(certificates + "/server.pem", certificates + "/server.key")
        server.socket = context.wrap_socket(server.socket, server_side=True)
        with open(certificates + "/port.tmp", "w") as f:
            f.write(str(server.server_address[1]))
        import os
        os.replace(certificates + "/port.tmp", certificates + "/port")
        server.serve_forever()
        """#
}

extension CredentialHelperTests {
    static var registryTools: Bool {
        FileManager.default.isExecutableFile(atPath: "/usr/bin/skopeo") && FileManager.default.isExecutableFile(atPath: "/usr/bin/docker-registry")
    }

    @Test("real skopeo and docker-registry with token authentication: a plain-http registry gets no https entry's token; with http:// written, docker-credential-tokenbroker gives the broker's token, the registry's token service accepts it; push, inspect; 8 parallel inspects after the token expired cost one refresh",
          .enabled(if: CredentialHelperTests.registryTools, "no skopeo or docker-registry here"))
    func realRegistry() async throws {
        let issuer = try Self.shortLivedIssuer()
        defer { issuer.stop() }
        let certificates = try await TestCertificates.make()
        defer { try? FileManager.default.removeItem(atPath: certificates) }
        let work = try Paths.temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: work) }
        try Self.registryScript.write(toFile: work + "/registry_side.py", atomically: true, encoding: .utf8)
        // The registry (docker-registry, token auth) and its token service, which grants a pull
        // and push token for a Basic password the issuer's protected resource accepts.
        let side = Process()
        side.executableURL = URL(fileURLWithPath: "/usr/bin/python3")
        side.arguments = [work + "/registry_side.py", issuer.resourceURL, certificates, work]
        let control = Pipe()
        side.standardInput = control
        side.standardOutput = FileHandle.nullDevice
        side.standardError = FileHandle.nullDevice
        try side.run()
        defer {
            try? control.fileHandleForWriting.close()
            side.waitUntilExit()
        }
        // The side publishes its ports once the registry answers (a file: no pipe protocol to keep in step).
        try await eventually("the registry side publishes its ports", timeout: .seconds(30)) {
            FileManager.default.fileExists(atPath: work + "/ports.json")
        }
        let published = try #require(FileManager.default.contents(atPath: work + "/ports.json"))
        let ports = try #require(try JSONParser.parse(ArraySlice(published)).objectValue)
        let registry = try #require(ports["registry"]?.intValue)
        // First a bare entry (https): the registry is plain HTTP, so skopeo must get nothing.
        let config = "[Broker]\nSocketMode=0666\n\n" + Broker.oauthSession(issuer.tokenEndpoint, name: "images") + "RefreshAhead=0\nServes=%@127.0.0.1:\(registry)\n"
        let broker = try await Broker(config: config.replacingOccurrences(of: "%@", with: ""))
        defer { try? FileManager.default.removeItem(atPath: broker.directory) }
        #expect(try broker.call("Login", ["session": "images", "refreshToken": .string(issuer.issueRefreshToken())]).error == nil)
        // docker-credential-tokenbroker on PATH, named in the auth file's credHelpers.
        let bin = broker.directory + "/bin"
        try FileManager.default.createDirectory(atPath: bin, withIntermediateDirectories: true)
        try FileManager.default.createSymbolicLink(atPath: bin + "/docker-credential-tokenbroker", withDestinationPath: Paths.tokenbroker)
        let authfile = broker.directory + "/auth.json"
        try #"{"credHelpers": {"127.0.0.1:\#(registry)": "tokenbroker"}}"#.write(toFile: authfile, atomically: true, encoding: .utf8)
        func skopeo(_ arguments: [String]) async throws -> (code: Int32, out: String, err: String) {
            var environment = ProcessInfo.processInfo.environment
            environment["PATH"] = bin + ":" + (environment["PATH"] ?? "/usr/bin:/bin")
            environment["TOKENBROKER_SOCKET"] = broker.socket
            environment["HOME"] = broker.directory
            let child = try Child("/usr/bin/skopeo", ["--insecure-policy"] + arguments, environment: environment, directory: broker.directory)
            let code = await child.wait(timeout: 120)
            return (code, child.stdout, child.stderr)
        }
        let image = "docker://127.0.0.1:\(registry)/demo:1"
        let refused = try await skopeo(["copy", "--dest-tls-verify=false", "--authfile", authfile, "oci:\(work)/image:1", image])
        #expect(refused.code != 0, "skopeo copy to a plain-http registry went through with an https entry's token")
        let seen = FileManager.default.contents(atPath: work + "/counts.json").flatMap { try? JSONParser.parse(ArraySlice($0)).objectValue }
        #expect((seen?["granted"]?.intValue ?? 0) == 0, "the token service was handed the broker's token over plain HTTP: \(seen ?? [:])")
        let refusedBefore = seen?["refused"]?.intValue ?? 0
        // `http://` written: the operator accepts the token in clear to this (loopback) registry.
        try config.replacingOccurrences(of: "%@", with: "http://").replacingOccurrences(of: "@DIR@", with: broker.directory)
            .write(toFile: broker.configPath, atomically: true, encoding: .utf8)
        #expect(try broker.call("Reload").error == nil)
        let push = try await skopeo(["copy", "--dest-tls-verify=false", "--authfile", authfile, "oci:\(work)/image:1", image])
        #expect(push.code == 0, "skopeo copy: \(push.err)")
        let inspect = try await skopeo(["inspect", "--tls-verify=false", "--authfile", authfile, image])
        let check110 = inspect.code == 0 && inspect.out.contains("\"Name\": \"127.0.0.1:\(registry)/demo\"")
        #expect(check110, "skopeo inspect: \(inspect.err)")

        // After the token expired: 8 inspects at once, one refresh.
        try await Self.waitUntilExpired(broker, "images")
        let before = issuer.counters.refreshGrants
        let codes = try await withThrowingTaskGroup(of: Int32.self) { group in
            for _ in 0..<8 { group.addTask { try await skopeo(["inspect", "--tls-verify=false", "--authfile", authfile, image]).code } }
            return try await group.reduce(into: []) { $0.append($1) }
        }
        #expect(codes.count == 8 && codes.allSatisfy { $0 == 0 }, "inspects failed: \(codes.filter { $0 != 0 }.count)")
        #expect(issuer.counters.refreshGrants == before + 1, "8 inspects after the expiry cost \(issuer.counters.refreshGrants - before) refreshes")
        // The token service never saw a password it refused.
        let countsFile = try #require(FileManager.default.contents(atPath: work + "/counts.json"))
        let counts = try #require(try JSONParser.parse(ArraySlice(countsFile)).objectValue)
        #expect(counts["refused"]?.intValue == refusedBefore && (counts["granted"]?.intValue ?? 0) >= 10, "token service: \(counts)")
        _ = await broker.stop()
    }

    /// The registry side: docker-registry with token authentication, its token service (JWTs
    /// signed with the test server key, its certificate in x5c, the test CA as the registry's
    /// root), and a one-layer OCI image to push. argv: the issuer's resource URL, the
    /// certificates' directory, a work directory, where it writes ports.json when the registry
    /// answers and counts.json at each token it grants or refuses; it ends at the end of its input.
    static let registryScript = #"""
        import base64, hashlib, http.server, io, json, os, socket, socketserver, subprocess, sys, tarfile, threading, time, urllib.request, urllib.error, uuid

        check, certificates, work = sys.argv[1], sys.argv[2], sys.argv[3]

        def valid(password):
            if check.startswith("http"):
                try:
                    return urllib.request.urlopen(urllib.request.Request(check, headers={"Authorization": "Bearer " + password}), timeout=10).status == 200
                except urllib.error.URLError:
                    return False
            return password == open(check).read().strip()

        def free_port():
            s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close(); return port

        def b64url(data):
            return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

        def der(pem_path):
            text = open(pem_path).read()
            body = text.split("-----BEGIN CERTIFICATE-----")[1].split("-----END CERTIFICATE-----")[0]
            return "".join(body.split())

        def jwt(scope, subject):
            access = []
            if scope:
                kind, name, actions = scope.split(":", 2)
                access.append({"type": kind, "name": name, "actions": actions.split(",")})
            now = int(time.time())
            header = {"alg": "RS256", "typ": "JWT", "x5c": [der(certificates + "/server.pem")]}
            claims = {"iss": "tb-token-service", "sub": subject, "aud": "tb-registry", "exp": now + 300, "nbf": now - 10, "iat": now,
                      "jti": uuid.uuid4().hex, "access": access}
            signing = b64url(json.dumps(header).encode()) + "." + b64url(json.dumps(claims).encode())
            signature = subprocess.run(["openssl", "dgst", "-sha256", "-sign", certificates + "/server.key"], input=signing.encode(),
                                       capture_output=True, check=True).stdout
            return signing + "." + b64url(signature)

        granted = [0]
        refused = [0]
        lock = threading.Lock()
        class Token(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            def do_GET(self):
                from urllib.parse import urlparse, parse_qs
                query = parse_qs(urlparse(self.path).query)
                auth = self.headers.get("Authorization", "")
                ok = False
                user = ""
                if auth.startswith("Basic "):
                    user, _, password = base64.b64decode(auth[6:]).decode().partition(":")
                    ok = valid(password)
                if not ok:
                    refused[0] += 1
                    body = b'{"errors":[{"code":"UNAUTHORIZED"}]}'
                    self.send_response(401)
                else:
                    granted[0] += 1
                    token = jwt(query.get("scope", [""])[0], user)
                    body = json.dumps({"token": token, "access_token": token, "expires_in": 300}).encode()
                    self.send_response(200)
                with lock:
                    with open(work + "/counts.tmp", "w") as f:
                        json.dump({"granted": granted[0], "refused": refused[0]}, f)
                    os.replace(work + "/counts.tmp", work + "/counts.json")
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            def log_message(self, *a): pass

        class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
            daemon_threads = True

        token_server = Server(("127.0.0.1", 0), Token)
        threading.Thread(target=token_server.serve_forever, daemon=True).start()
        token_port = token_server.server_address[1]
        registry_port = free_port()
        config = f"""version: 0.1
        storage:
          filesystem:
            rootdirectory: {work}/data
        http:
          addr: 127.0.0.1:{registry_port}
        auth:
          token:
            realm: http://127.0.0.1:{token_port}/token
            service: tb-registry
            issuer: tb-token-service
            rootcertbundle: {certificates}/ca.pem
        """
        open(work + "/registry.yml", "w").write(config)
        registry = subprocess.Popen(["docker-registry", "serve", work + "/registry.yml"], stdout=subprocess.DEVNULL, stderr=open(work + "/registry.log", "w"))

        # A one-layer OCI image in work/image.
        def blob(data):
            digest = hashlib.sha256(data).hexdigest()
            os.makedirs(work + "/image/blobs/sha256", exist_ok=True)
            open(f"{work}/image/blobs/sha256/{digest}", "wb").write(data)
            return {"digest": "sha256:" + digest, "size": len(data)}
        layer_bytes = io.BytesIO()
        with tarfile.open(fileobj=layer_bytes, mode="w") as archive:
            content = b"hello from tokenbroker\n"
            info = tarfile.TarInfo("hello.txt"); info.size = len(content); info.mtime = 0
            archive.addfile(info, io.BytesIO(content))
        layer = blob(layer_bytes.getvalue())
        layer["mediaType"] = "application/vnd.oci.image.layer.v1.tar"
        diff_id = layer["digest"]
        cfg = blob(json.dumps({"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": [diff_id]}, "config": {}}).encode())
        cfg["mediaType"] = "application/vnd.oci.image.config.v1+json"
        manifest = blob(json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json", "config": cfg, "layers": [layer]}).encode())
        manifest["mediaType"] = "application/vnd.oci.image.manifest.v1+json"
        manifest["annotations"] = {"org.opencontainers.image.ref.name": "1"}
        open(work + "/image/oci-layout", "w").write('{"imageLayoutVersion": "1.0.0"}')
        open(work + "/image/index.json", "w").write(json.dumps({"schemaVersion": 2, "manifests": [manifest]}))

        # Ready when the registry answers.
        deadline = time.time() + 20
        while time.time() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{registry_port}/v2/", timeout=1)
            except urllib.error.HTTPError:
                break
            except OSError:
                time.sleep(0.05)
        def publish(name, value):
            with open(work + "/" + name + ".tmp", "w") as f:
                json.dump(value, f)
            os.replace(work + "/" + name + ".tmp", work + "/" + name)
        publish("ports.json", {"registry": registry_port, "token": token_port})
        sys.stdin.read()
        registry.terminate()
        registry.wait()

        """#
}
