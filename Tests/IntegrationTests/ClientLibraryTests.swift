import DevIssuer
import Foundation
#if canImport(FoundationNetworking)
import FoundationNetworking
#endif
import Testing
import TestSupport
import TokenBrokerClient
import TokenBrokerURLSession
import WireJSON

/// The Swift client library against the real daemon, and its retry helper against the
/// development issuer's protected resource.
@Suite("TokenBrokerClient", .serialized)
struct ClientLibraryTests {
    /// Runs `body` with an issuer, a daemon whose session `api` is logged in there, and a client.
    static func withClient(_ body: (DevIssuer, Broker, TokenBrokerClient) async throws -> Void) async throws {
        let issuer = try DevIssuer()
        defer { issuer.stop() }
        let broker = try await Broker.loggedIn(tokenEndpoint: issuer.tokenEndpoint, refreshToken: issuer.issueRefreshToken())
        defer { broker.child.terminate() }
        try await body(issuer, broker, TokenBrokerClient(socketPath: broker.socket))
    }

    @Test("typed errors mirror the contract's")
    func typedErrors() async throws {
        try await Self.withClient { issuer, broker, client in
            await #expect(throws: TokenBrokerError.noSuchSession("nope")) { try await client.token(session: "nope") }
            _ = try broker.call("Logout", ["session": "api"])
            await #expect(throws: TokenBrokerError.signedOut("api")) { try await client.token(session: "api") }
            let nowhere = TokenBrokerClient(socketPath: broker.directory + "/no-such.sock")
            do {
                _ = try await nowhere.token(session: "api")
                Issue.record("no broker, yet a token")
            } catch {
                guard case .unavailable? = error as? TokenBrokerError else { Issue.record("expected unavailable, got \(error)"); return }
            }
        }
    }

    @Test("the connection is re-established after the broker restarts")
    func reconnect() async throws {
        let issuer = try DevIssuer()
        defer { issuer.stop() }
        let broker = try await Broker.loggedIn(tokenEndpoint: issuer.tokenEndpoint, refreshToken: issuer.issueRefreshToken())
        let client = TokenBrokerClient(socketPath: broker.socket)
        let first = try await client.token(session: "api")
        #expect(await broker.stop() == 0)
        let restarted = try await PersistenceTests.restart(broker)
        defer { restarted.terminate() }
        let second = try await client.token(session: "api")
        #expect(second == first)
    }

    @Test("watch streams the current token, new tokens, and the logout")
    func watch() async throws {
        try await Self.withClient { issuer, broker, client in
            let first = try await client.token(session: "api")
            var events = client.watch(session: "api").makeAsyncIterator()
            #expect(try await events.next() == .token(first, serial: 1))
            let second = try await client.recover(session: "api", rejected: first.token)
            #expect(try await events.next() == .token(second, serial: 2))
            _ = try broker.call("Logout", ["session": "api"])
            #expect(try await events.next() == .signedOut(generation: 2))
            #expect(try await events.next() == nil)
        }
    }

    @Test("retry rules against the protected resource: 401 invalid_token → one recover and one retry")
    func retryOnce() async throws {
        try await Self.withClient { issuer, broker, client in
            let stale = try await client.token(session: "api")
            issuer.revokeAccessToken(stale.token)
            let before = issuer.counters
            let (_, response) = try await client.data(for: URLRequest(url: URL(string: issuer.resourceURL)!), session: "api")
            #expect(response.statusCode == 200)
            #expect(issuer.counters.refreshGrants == before.refreshGrants + 1)
            #expect(issuer.counters.resourceRequests == before.resourceRequests + 2)
        }
    }

    @Test("403 insufficient_scope: no recover, no retry")
    func forbidden() async throws {
        try await Self.withClient { issuer, broker, client in
            _ = try await client.token(session: "api")
            let before = issuer.counters
            let (_, response) = try await client.data(for: URLRequest(url: URL(string: issuer.resourceURL + "?scope=admin")!), session: "api")
            #expect(response.statusCode == 403)
            #expect(issuer.counters.refreshGrants == before.refreshGrants && issuer.counters.resourceRequests == before.resourceRequests + 1)
        }
    }

    @Test("a second 401 goes back to the caller: exactly one recover")
    func secondRejection() async throws {
        try await Self.withClient { issuer, broker, client in
            _ = try await client.token(session: "api")
            issuer.setResourceRejectsAll(true)
            let before = issuer.counters
            let (_, response) = try await client.data(for: URLRequest(url: URL(string: issuer.resourceURL)!), session: "api")
            #expect(response.statusCode == 401)
            #expect(issuer.counters.refreshGrants == before.refreshGrants + 1 && issuer.counters.resourceRequests == before.resourceRequests + 2)
        }
    }

    @Test("a request whose body is a stream is never sent twice; POST without Idempotency-Key neither, with one it is")
    func noReplay() async throws {
        try await Self.withClient { issuer, broker, client in

            var stream = URLRequest(url: URL(string: issuer.resourceURL)!)
            stream.httpMethod = "PUT"
            stream.httpBodyStream = InputStream(data: Data("payload".utf8))
            issuer.revokeAccessToken(try await client.token(session: "api").token)
            var before = issuer.counters
            #expect(try await client.data(for: stream, session: "api").1.statusCode == 401)
            #expect(issuer.counters.refreshGrants == before.refreshGrants && issuer.counters.resourceRequests == before.resourceRequests + 1)

            var post = URLRequest(url: URL(string: issuer.resourceURL)!)
            post.httpMethod = "POST"
            post.httpBody = Data("order".utf8)
            before = issuer.counters
            #expect(try await client.data(for: post, session: "api").1.statusCode == 401)
            #expect(issuer.counters.refreshGrants == before.refreshGrants)

            post.setValue("order-42", forHTTPHeaderField: "Idempotency-Key")
            #expect(try await client.data(for: post, session: "api").1.statusCode == 200)
            #expect(issuer.counters.refreshGrants == before.refreshGrants + 1)
        }
    }

    @Test("the example worker calls the resource through the broker")
    func exampleWorker() async throws {
        try await Self.withClient { issuer, broker, _ in
            let worker = try Child(Paths.binaries.appendingPathComponent("example-worker").path,
                                   ["--socket", broker.socket, "--session", "api", issuer.resourceURL], directory: broker.directory)
            #expect(await worker.wait() == 0, "\(worker.stderr)")
            #expect(worker.stdout.hasPrefix("HTTP 200"))
        }
    }
}
