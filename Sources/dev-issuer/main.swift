#if canImport(Glibc)
import Glibc
#endif
import Basics
import DevIssuer

// dev-issuer: the development OAuth 2.0 authorization server as a process of its own, for tests
// that run the daemon somewhere the test process cannot reach into (a container booted with
// systemd). Loopback HTTP only. Not installed; never for production.
//
//   dev-issuer [--port N] [--client-id ID] --client-secret-file PATH [--refresh-token-file PATH]
//              [--dpop accepted|required] [--dpop-nonces] [--access-token-lifetime SECONDS]
//
// Prints `issuer http://127.0.0.1:PORT` on stdout once it listens; `--refresh-token-file`
// receives (mode 0600) a refresh token of a new login, so no token passes through a test's
// output. Stops on SIGTERM or SIGINT.

let usage = "usage: dev-issuer [--port N] [--client-id ID] --client-secret-file PATH [--refresh-token-file PATH] [--dpop accepted|required] [--dpop-nonces] "
    + "[--access-token-lifetime SECONDS]\n"

func emit(_ text: String, to fd: Int32) {
    let bytes = Array(text.utf8)
    _ = write(fd, bytes, bytes.count)
}

func fail(_ message: String) -> Never {
    emit("dev-issuer: \(message)\n\(usage)", to: 2)
    exit(64)
}

func readSecret(_ path: String) -> String {
    guard let file = fopen(path, "r") else { fail("cannot read \(path)") }
    defer { fclose(file) }
    var buffer = [CChar](repeating: 0, count: 4096)
    guard fgets(&buffer, Int32(buffer.count), file) != nil else { fail("\(path) is empty") }
    let line = String(decoding: buffer.prefix { $0 != 0 }.map { UInt8(bitPattern: $0) }, as: UTF8.self)
    let secret = line.hasSuffix("\n") ? String(line.dropLast()) : line
    guard !secret.isEmpty else { fail("\(path) is empty") }
    return secret
}

var options = DevIssuer.Options()
var clientID = "tokenbroker"
var secretFile: String?
var refreshTokenFile: String?
var arguments = CommandLine.arguments.dropFirst()
while let argument = arguments.popFirst() {
    switch argument {
    case "--port":
        guard let value = arguments.popFirst(), let port = UInt16(value) else { fail("--port needs a number") }
        options.port = port
    case "--client-id":
        guard let value = arguments.popFirst(), !value.isEmpty else { fail("--client-id needs an id") }
        clientID = value
    case "--client-secret-file":
        guard let value = arguments.popFirst() else { fail("--client-secret-file needs a path") }
        secretFile = value
    case "--refresh-token-file":
        guard let value = arguments.popFirst() else { fail("--refresh-token-file needs a path") }
        refreshTokenFile = value
    case "--dpop":
        switch arguments.popFirst() {
        case "accepted": options.dpop = .accepted
        case "required": options.dpop = .required
        default: fail("--dpop needs accepted or required")
        }
    case "--dpop-nonces":
        options.dpopNonces = true
    case "--access-token-lifetime":
        guard let value = arguments.popFirst(), let seconds = Int(value), (1...86_400).contains(seconds) else {
            fail("--access-token-lifetime needs 1 to 86400 seconds")
        }
        options.accessTokenLifetime = .seconds(seconds)
    case "-h", "--help":
        emit(usage, to: 1)
        exit(0)
    default:
        fail("unknown argument '\(argument)'")
    }
}
guard let secretFile else { fail("--client-secret-file is required") }
options.clients = [clientID: readSecret(secretFile)]

let issuer: DevIssuer
do {
    issuer = try DevIssuer(options: options)
} catch {
    fail("cannot listen: \(error)")
}
if let refreshTokenFile {
    let fd = open(refreshTokenFile, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0o600)
    guard fd >= 0 else { fail("cannot write \(refreshTokenFile)") }
    let bytes = Array(issuer.issueRefreshToken(clientID: clientID).utf8)
    guard write(fd, bytes, bytes.count) == bytes.count else { fail("cannot write \(refreshTokenFile)") }
    close(fd)
}
emit("issuer \(issuer.baseURL)\n", to: 1)

waitForTerminationSignal()
issuer.stop()
