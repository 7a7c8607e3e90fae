import DevIssuer
import Foundation
#if canImport(Glibc)
import Glibc
#endif
import Testing
import TestSupport
import Varlink

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
            #expect(none.code == 0 && none.out.isEmpty)
            let worst = try await Self.helper(broker, ["credential", "git", "get"], stdin: String(repeating: "x", count: 70_000))
            let check4 = worst.code != 0 && worst.out.isEmpty && !worst.err.contains(repos)
            #expect(check4)
            #expect(try await Self.helper(broker, ["credential", "git", "store"], stdin: "host=git.example.test\npassword=p\n\n").code == 0)
            let unknown = try await Self.helper(broker, ["credential", "git", "frobnicate"])
            #expect(unknown.code == 64 && unknown.out.isEmpty)

            // docker-credential-tokenbroker, as docker runs it.
            let docker = try await Self.helper(broker, ["get"], stdin: "registry.example.test\n", as: "docker-credential-tokenbroker")
            let check5 = docker.code == 0 && docker.out == #"{"ServerURL":"registry.example.test","Username":"oauth2","Secret":"\#(repos)"}"# + "\n"
            #expect(check5, "\(fp(docker.out)) \(docker.err)")
            let missing = try await Self.helper(broker, ["get"], stdin: "other.test\n", as: "docker-credential-tokenbroker")
            #expect(missing.code == 1 && missing.out == "credentials not found in native keychain\n")
            #expect(try await Self.helper(broker, ["list"], as: "docker-credential-tokenbroker").out == "{}\n")

            // Terraform and Bazel.
            let terraform = try await Self.helper(broker, ["get", "app.terraform.test"], as: "terraform-credentials-tokenbroker")
            let check6 = terraform.code == 0 && terraform.out == #"{"token":"\#(repos)"}"# + "\n"
            #expect(check6)
            #expect(try await Self.helper(broker, ["get", "nobody.test"], as: "terraform-credentials-tokenbroker").out == "{}\n")
            let bazel = try await Self.helper(broker, ["credential", "bazel", "get"], stdin: #"{"uri":"https://git.example.test/org/a"}"#)
            let check7 = bazel.code == 0 && bazel.out.hasPrefix(#"{"headers":{"Authorization":["Bearer \#(repos)"]},"expires":""#)
            #expect(check7)
            let badBazel = try await Self.helper(broker, ["credential", "bazel", "get"], stdin: "{uri")
            #expect(badBazel.code == 1 && badBazel.out.isEmpty)

            // kubectl's exec plugin, both API versions.
            for version in ["client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1"] {
                let info = #"{"apiVersion":"\#(version)","kind":"ExecCredential","spec":{"cluster":{"server":"https://127.0.0.1:6443"},"interactive":false}}"#
                let kube = try await Self.helper(broker, ["credential", "kubectl"], environment: ["KUBERNETES_EXEC_INFO": info])
                let check8 = kube.code == 0 && kube.out.hasPrefix(#"{"apiVersion":"\#(version)","kind":"ExecCredential","status":{"token":"\#(repos)","expirationTimestamp":""#)
                #expect(check8, "\(fp(kube.out)) \(kube.err)")
            }
            let badInfo = try await Self.helper(broker, ["credential", "kubectl", "--url", "https://127.0.0.1:6443"],
                                                environment: ["KUBERNETES_EXEC_INFO": #"{"apiVersion":"v0"}"#])
            #expect(badInfo.code == 1 && badInfo.out.isEmpty)
            // A worker asking for what only root's session serves learns nothing of it.
            let probe = try await Self.helper(broker, ["credential", "kubectl", "--url", "https://git.example.test/org/private"], worker: true)
            let check9 = probe.out.contains(repos) && !probe.out.contains(privateToken)
            #expect(check9)
            let stranger = try await Self.helper(broker, ["credential", "kubectl", "--url", "https://nobody.test"], worker: true)
            #expect(stranger.code == 1 && stranger.out.isEmpty && stranger.err.contains("no session this user may use serves"))
        }
    }
}
