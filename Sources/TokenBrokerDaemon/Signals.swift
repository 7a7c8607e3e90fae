#if canImport(Glibc)
import Glibc
#endif
import Dispatch

/// The signals `serve` handles, as an async sequence (Dispatch signal sources, which read a
/// signalfd on Linux).
///
/// `block()` runs first, on the main thread before any other thread exists
/// (`TokenBrokerCommand.main`): the signals are then blocked in every thread, since each
/// inherits the mask (libdispatch's workers block them too), so one that arrives before the
/// stream exists stays pending — neither killing the process with the default action nor being
/// lost — until the stream's signalfd reads it. (Their disposition is left alone: setting
/// `SIG_IGN` would discard one already pending.)
public enum Signals {
    static let handled: [Int32] = [SIGTERM, SIGINT, SIGHUP]

    public static func block() {
        var set = sigset_t()
        sigemptyset(&set)
        for number in handled { sigaddset(&set, number) }
        pthread_sigmask(SIG_BLOCK, &set, nil)
    }

    static func stream() -> AsyncStream<Int32> {
        AsyncStream { continuation in
            // One serial queue: signals come out in the order they were read (a SIGTERM sent
            // before a SIGHUP is seen first).
            let queue = DispatchQueue(label: "tokenbroker.signals")
            let sources = handled.map { number -> any DispatchSourceSignal in
                let source = DispatchSource.makeSignalSource(signal: number, queue: queue)
                source.setEventHandler { continuation.yield(number) }
                source.resume()
                return source
            }
            let box = SignalSources(sources)
            continuation.onTermination = { _ in box.cancel() }
        }
    }

    private final class SignalSources: @unchecked Sendable {
        // @unchecked: the sources are only cancelled (DispatchSource.cancel is thread-safe) and
        // never mutated after init.
        let sources: [any DispatchSourceSignal]
        init(_ sources: [any DispatchSourceSignal]) { self.sources = sources }
        func cancel() { for source in sources { source.cancel() } }
    }
}
