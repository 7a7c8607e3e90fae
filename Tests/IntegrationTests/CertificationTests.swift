import Foundation
import Testing
import TestSupport

/// Conformance of our varlink layer against independent implementations: the Go and Python
/// certification clients against our service, and our client against their services.
@Suite("varlink certification", .serialized)
struct CertificationTests {
    static let goCertification = "/usr/bin/varlink-go-certification"

    @Test("the Go and Python certification clients pass against our service")
    func theirClientsOurServer() async throws {
        let directory = try Paths.temporaryDirectory()
        let socket = "\(directory)/cert.sock"
        let server = try Child(Paths.certification, ["serve", "--varlink", "unix:\(socket)"], directory: directory)
        defer { server.terminate() }
        try await waitForSocket(socket)

        let go = try Child(Self.goCertification, ["-client", "-varlink", "unix:\(socket)"], directory: directory)
        #expect(await go.wait() == 0, "Go client: \(go.stdout.suffix(400)) \(go.stderr.suffix(400))")
        #expect(go.stdout.contains("End: 'true'"))

        let python = try Child(Paths.varlinkPython, ["-m", "varlink.tests.test_certification", "--client", "--varlink=unix:\(socket)"],
                               directory: directory)
        #expect(await python.wait() == 0, "Python client: \(python.stderr.suffix(400))")
        #expect(python.stdout.contains("Certification passed"))

        server.terminate()
        #expect(await server.wait() == 0)
    }

    @Test("our client passes against the Go and Python certification services")
    func ourClientTheirServers() async throws {
        let directory = try Paths.temporaryDirectory()
        let servers: [(String, String, [String])] = [
            ("Go", Self.goCertification, ["-varlink", "unix:\(directory)/go.sock"]),
            ("Python", Paths.varlinkPython, ["-m", "varlink.tests.test_certification", "--varlink=unix:\(directory)/python.sock"]),
        ]
        for (name, executable, arguments) in servers {
            let socket = "\(directory)/\(name.lowercased()).sock"
            let server = try Child(executable, arguments, directory: directory)
            defer { server.kill() }
            try await waitForSocket(socket)
            let client = try Child(Paths.certification, ["client", "--varlink", "unix:\(socket)"], directory: directory)
            #expect(await client.wait() == 0, "our client against \(name): \(client.stderr)")
            #expect(client.stdout.contains("Certification passed"))
        }
    }
}
