import Basics

/// A long-lived part of the daemon: it runs until told to stop, then stops gracefully.
protocol DaemonService: Sendable {
    var name: String { get }
    /// Runs until `stop()` has been called and the graceful stop is done, or until it fails.
    func run() async throws
    /// Asks `run()` to finish (returns at once; calling it again has no effect).
    func stop()
}

/// A part given by what it does until its stop latch fires (and how it stops then).
struct DaemonPart: DaemonService {
    let name: String
    private let body: @Sendable (Latch) async throws -> Void
    private let stopped = Latch()

    init(_ name: String, _ body: @escaping @Sendable (_ stop: Latch) async throws -> Void) {
        self.name = name
        self.body = body
    }

    func run() async throws { try await body(stopped) }
    func stop() { stopped.fire() }
}

/// Runs the daemon's parts as one task tree, in the spirit of swift-service-lifecycle's
/// `ServiceGroup`: all start together in one task group; when a shutdown is requested (the
/// `shutdown` latch fires, e.g. on SIGTERM) or any part ends on its own, the parts are stopped
/// one by one in reverse order, each awaited before the next. So a part listed before another
/// outlives it: the HTTP loop outlives the sessions that refresh through it, which outlive the
/// listener that drains the calls waiting on them.
struct ServiceGroup {
    let parts: [any DaemonService]
    /// Fires when the graceful shutdown begins (whoever asks for it).
    let shutdown: Latch
    /// Told what happened, for the log.
    let report: @Sendable (String) -> Void

    /// Runs every part to its end; returns the names of those that failed.
    func run() async -> [String] {
        await withTaskGroup(of: (index: Int, failure: String?).self) { group in
            for (index, part) in parts.enumerated() {
                group.addTask {
                    do {
                        try await part.run()
                        return (index, nil)
                    } catch {
                        return (index, "\(error)")
                    }
                }
            }
            group.addTask { [shutdown] in
                await shutdown.wait()
                return (-1, nil)
            }
            var ended: Set<Int> = []
            var failed: [String] = []
            func record(_ result: (index: Int, failure: String?)) {
                guard result.index >= 0 else { return }
                ended.insert(result.index)
                if let failure = result.failure {
                    failed.append(parts[result.index].name)
                    report("\(parts[result.index].name) failed: \(failure)")
                }
            }
            // Until a shutdown is requested, or a part ends by itself (then everything stops).
            if let first = await group.next() {
                record(first)
                if first.index >= 0 { report("\(parts[first.index].name) ended; stopping the rest") }
            }
            shutdown.fire()
            for index in parts.indices.reversed() where !ended.contains(index) {
                parts[index].stop()
                while !ended.contains(index), let next = await group.next() { record(next) }
            }
            while let next = await group.next() { record(next) }
            return failed
        }
    }
}
