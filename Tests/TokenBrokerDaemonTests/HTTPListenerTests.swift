import Foundation
import Testing
import Basics
@testable import TokenBrokerDaemon

/// The HTTP listener's work belongs to it: after a stop, it is finished only once its loop's
/// thread has closed the socket and every request's work has ended.
@Suite("HTTP listener")
struct HTTPListenerTests {
    /// Sends one request to 127.0.0.1:`port` (the connection is left open).
    static func send(_ port: UInt16, _ request: String) throws -> Int32 {
        let fd = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
        var address = sockaddr_in()
        address.sin_family = sa_family_t(AF_INET)
        address.sin_port = port.bigEndian
        address.sin_addr.s_addr = inet_addr("127.0.0.1")
        let connected = withUnsafePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { connect(fd, $0, socklen_t(MemoryLayout<sockaddr_in>.size)) }
        }
        guard connected == 0 else { throw POSIXError(.ECONNREFUSED) }
        _ = request.withCString { write(fd, $0, strlen($0)) }
        return fd
    }

    /// A listener whose one request's work waits for `release` (or its cancellation), and says
    /// when it has ended and whether it was cancelled.
    static func held(_ release: Latch) throws -> (HTTPListener, started: Latch, done: Latch, cancelled: SynchronizedBox<Bool>) {
        let listener = try HTTPListener(.tcp(host: "127.0.0.1", port: 0))
        let started = Latch(), done = Latch()
        let cancelled = SynchronizedBox(false)
        listener.start(route: { _, _ in
            .work {
                started.fire()
                await release.wait()
                cancelled.value = Task.isCancelled
                done.fire()
                return HTTPListener.response(200, "ok\n")
            }
        }, refused: { _ in })
        return (listener, started, done, cancelled)
    }

    @Test("after a stop, finished waits for the work under way, which runs to its end (issue 34)")
    func workRunsToItsEnd() async throws {
        let release = Latch()
        let (listener, started, done, cancelled) = try Self.held(release)
        let client = try Self.send(listener.port, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        defer { close(client) }
        #expect(await started.wait(upTo: .seconds(10)), "the work started")
        listener.stop()
        async let finished = listener.finished(within: .seconds(30))
        #expect(!done.hasFired)
        release.fire()
        #expect(await finished)
        #expect(done.hasFired && !cancelled.value, "the work ran to its end, uncancelled, before finished said so")
        #expect((try? Self.send(listener.port, "GET / HTTP/1.1\r\n\r\n")) == nil, "the socket is closed")
    }

    @Test("work still running at finished's deadline is the listener's to cancel: none outlives it (issue 34)")
    func workIsOwned() async throws {
        let (listener, started, done, cancelled) = try Self.held(Latch())   // never released
        let client = try Self.send(listener.port, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        defer { close(client) }
        #expect(await started.wait(upTo: .seconds(10)), "the work started")
        listener.stop()
        #expect(await listener.finished(within: .milliseconds(100)))
        #expect(done.hasFired && cancelled.value, "the work was cancelled and ended before finished returned")
    }
}
