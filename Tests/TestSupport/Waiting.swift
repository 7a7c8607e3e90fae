import Synchronization
import Testing

/// Why a wait gave up.
public struct TimedOut: Error, CustomStringConvertible {
    public let what: String
    public var description: String { "timed out waiting for \(what)" }
}

/// Waits until `condition` holds and fails (recording an issue) after `timeout` of real time.
/// This waits *for a state*; it never sleeps to make an interleaving happen. It yields between
/// checks, and after the first hundred (a state that needs another process, say) checks once a
/// millisecond, so that a long wait does not take a core from what it waits for.
///
/// The deadline bounds each check too: a condition that itself awaits something that never
/// comes (a broken guarantee parks a call for ever) is cancelled, and the wait fails instead of
/// hanging the suite.
public func eventually(_ what: String, timeout: Duration = .seconds(20), sourceLocation: SourceLocation = #_sourceLocation,
                       _ condition: @escaping @Sendable () async throws -> Bool) async throws {
    let clock = ContinuousClock()
    let deadline = clock.now + timeout
    let outcome = Outcome()
    let held: Bool = try await withTaskCancellationHandler {
        try await withCheckedThrowingContinuation { continuation in
            outcome.start(continuation)
            let checker = Task {
                do {
                    var checks = 0
                    while !(try await condition()) {
                        if clock.now >= deadline { return outcome.finish(.success(false)) }
                        checks += 1
                        if checks < 100 { await Task.yield() } else { try await Task.sleep(for: .milliseconds(1)) }
                    }
                    outcome.finish(.success(true))
                } catch {
                    outcome.finish(.failure(error))
                }
            }
            let timer = Task {
                // Only a check that is still running at the deadline is cut short.
                try? await Task.sleep(until: deadline, clock: clock)
                if !Task.isCancelled { checker.cancel(); outcome.finish(.success(false)) }
            }
            outcome.onFinish { checker.cancel(); timer.cancel() }
        }
    } onCancel: {
        outcome.finish(.failure(CancellationError()))
    }
    if !held {
        Issue.record("timed out waiting for \(what)", sourceLocation: sourceLocation)
        throw TimedOut(what: what)
    }
}

/// The one result of a wait: the first of the check, the deadline or a cancellation wins.
private final class Outcome: Sendable {
    private struct State {
        var continuation: CheckedContinuation<Bool, any Error>?
        var result: Result<Bool, any Error>?
        var cleanup: (@Sendable () -> Void)?
    }
    private let state = Mutex(State())

    func start(_ continuation: CheckedContinuation<Bool, any Error>) {
        let early = state.withLock { state -> Result<Bool, any Error>? in
            if let result = state.result { return result }
            state.continuation = continuation
            return nil
        }
        if let early { continuation.resume(with: early) }
    }

    func onFinish(_ cleanup: @escaping @Sendable () -> Void) {
        let finished = state.withLock { state -> Bool in
            if state.result != nil { return true }
            state.cleanup = cleanup
            return false
        }
        if finished { cleanup() }
    }

    func finish(_ result: Result<Bool, any Error>) {
        let (continuation, cleanup) = state.withLock { state -> (CheckedContinuation<Bool, any Error>?, (@Sendable () -> Void)?) in
            guard state.result == nil else { return (nil, nil) }
            state.result = result
            defer { state.continuation = nil; state.cleanup = nil }
            return (state.continuation, state.cleanup)
        }
        continuation?.resume(with: result)
        cleanup?()
    }
}

extension Array {
    /// Every ordering of the elements (for small arrays: n! of them).
    public var permutations: [[Element]] {
        guard count > 1 else { return [self] }
        return indices.flatMap { index -> [[Element]] in
            var rest = self
            let head = rest.remove(at: index)
            return rest.permutations.map { [head] + $0 }
        }
    }
}
