import Basics
import Synchronization
import Testing
import TestSupport
@testable import TokenBrokerDaemon

@Suite("Service group")
struct ServiceGroupTests {
    final class Log: Sendable {
        private let entries = Mutex<[String]>([])
        func add(_ entry: String) { entries.withLock { $0.append(entry) } }
        var all: [String] { entries.withLock { $0 } }
    }

    /// A part that records its start and its stop, and (optionally) waits for `gate` while stopping.
    static func part(_ name: String, _ log: Log, gate: Latch? = nil) -> DaemonPart {
        DaemonPart(name) { stop in
            log.add("\(name) started")
            await stop.wait()
            if let gate { await gate.wait() }
            log.add("\(name) stopped")
        }
    }

    @Test("a shutdown stops the parts in reverse order, each awaited before the next")
    func reverseOrder() async throws {
        let log = Log()
        let shutdown = Latch()
        let slow = Latch()
        let group = ServiceGroup(parts: [Self.part("http", log), Self.part("sessions", log, gate: slow), Self.part("listener", log)],
                                 shutdown: shutdown, report: { log.add($0) })
        async let failed = group.run()
        try await eventually("every part started") { log.all.count == 3 }
        shutdown.fire()
        try await eventually("the listener stopped and the sessions stopping") { log.all.contains("listener stopped") }
        #expect(!log.all.contains("http stopped"), "the HTTP loop stopped before the sessions did")
        slow.fire()
        #expect(await failed == [])
        #expect(Array(log.all.suffix(3)) == ["listener stopped", "sessions stopped", "http stopped"])
    }

    @Test("a part that ends or fails by itself stops the others, and is reported")
    func partEnds() async throws {
        struct Broken: Error {}
        let log = Log()
        let shutdown = Latch()
        let group = ServiceGroup(parts: [Self.part("http", log), DaemonPart("listener") { _ in throw Broken() }, Self.part("signals", log)],
                                 shutdown: shutdown, report: { log.add($0) })
        #expect(await group.run() == ["listener"])
        #expect(shutdown.hasFired)
        #expect(log.all.contains("listener failed: Broken()") && log.all.contains("http stopped") && log.all.contains("signals stopped"))
        #expect(log.all.firstIndex(of: "signals stopped")! < log.all.firstIndex(of: "http stopped")!)
    }
}
