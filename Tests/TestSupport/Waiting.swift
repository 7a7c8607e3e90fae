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
public func eventually(_ what: String, timeout: Duration = .seconds(20), sourceLocation: SourceLocation = #_sourceLocation,
                       _ condition: () async throws -> Bool) async throws {
    let clock = ContinuousClock()
    let deadline = clock.now + timeout
    var checks = 0
    while !(try await condition()) {
        if clock.now >= deadline {
            Issue.record("timed out waiting for \(what)", sourceLocation: sourceLocation)
            throw TimedOut(what: what)
        }
        checks += 1
        if checks < 100 { await Task.yield() } else { try await Task.sleep(for: .milliseconds(1)) }
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
