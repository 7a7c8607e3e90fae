#if canImport(Glibc)
import Glibc
#endif

/// Blocks the calling thread until SIGTERM or SIGINT arrives (for small foreground tools that
/// serve until they are stopped); returns the signal. The two signals stay blocked in the
/// calling thread, so call it from the thread that would otherwise just exit.
@discardableResult
public func waitForTerminationSignal() -> Int32 {
    var signals = sigset_t()
    sigemptyset(&signals)
    sigaddset(&signals, SIGTERM)
    sigaddset(&signals, SIGINT)
    pthread_sigmask(SIG_BLOCK, &signals, nil)
    var received: Int32 = 0
    sigwait(&signals, &received)
    return received
}
