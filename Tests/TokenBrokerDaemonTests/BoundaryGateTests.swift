import Synchronization
import Testing
@testable import TokenBrokerDaemon

@Suite("Boundary gate")
struct BoundaryGateTests {
    /// A latch a holder parks on until the test opens it.
    final class Latch: Sendable {
        private let state = Mutex<(open: Bool, waiter: CheckedContinuation<Void, Never>?)>((false, nil))
        func wait() async {
            await withCheckedContinuation { continuation in
                let resumeNow = state.withLock { state -> Bool in
                    if state.open { return true }
                    state.waiter = continuation
                    return false
                }
                if resumeNow { continuation.resume() }
            }
        }
        func open() {
            state.withLock { state in
                state.open = true
                state.waiter?.resume()
                state.waiter = nil
            }
        }
    }

    final class Log: Sendable {
        private let entries = Mutex<[String]>([])
        func add(_ entry: String) { entries.withLock { $0.append(entry) } }
        var all: [String] { entries.withLock { $0 } }
    }

    static func until(_ what: String, _ condition: () async -> Bool) async throws {
        let deadline = ContinuousClock.now + .seconds(10)
        while !(await condition()) {
            guard ContinuousClock.now < deadline else {
                Issue.record("timed out waiting for \(what)")
                throw CancellationError()
            }
            await Task.yield()
        }
    }

    @Test("shared holders run together; the exclusive one waits for them and runs alone; a shared one arriving after it waits behind it")
    func order() async throws {
        let gate = BoundaryGate()
        let log = Log()
        let (first, second, swap) = (Latch(), Latch(), Latch())
        let entered: @Sendable (String) -> Void = { log.add($0) }
        async let a: Void = gate.shared { entered("a"); await first.wait(); entered("a done") }
        async let b: Void = gate.shared { entered("b"); await second.wait(); entered("b done") }
        try await Self.until("a and b inside") { log.all.count == 2 }
        async let e: Void = gate.exclusive { entered("exclusive"); await swap.wait(); entered("exclusive done") }
        try await Self.until("the exclusive holder queued") { await gate.queued == 1 }
        async let c: Void = gate.shared { entered("c") }
        try await Self.until("c queued behind it") { await gate.queued == 2 }
        first.open()
        try await Self.until("a out") { log.all.contains("a done") }
        #expect(!log.all.contains("exclusive"), "the exclusive holder entered while b was inside")
        second.open()
        try await Self.until("the exclusive holder inside") { log.all.contains("exclusive") }
        #expect(!log.all.contains("c"), "c entered during the exclusive hold")
        swap.open()
        _ = await (a, b, e, c)
        let order = log.all
        #expect(Array(order.suffix(3)) == ["exclusive", "exclusive done", "c"], "\(order)")
    }
}
