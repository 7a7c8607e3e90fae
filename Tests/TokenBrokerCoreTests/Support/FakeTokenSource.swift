import Synchronization
import Testing
import TestSupport
import TokenBrokerCore

/// A token source whose fetches park until the test releases them with `succeed` or `fail`.
/// A test waits for "fetch N started" (`started(_:)`) instead of sleeping. It ignores
/// cancellation on purpose: the worst case for the logout boundary is a transport that returns
/// success after it was cancelled.
final class FakeTokenSource: TokenSource {
    private struct State {
        var requests: [FetchRequest] = []
        var parked: [Int: CheckedContinuation<FetchedToken, any Error>] = [:]
    }

    private let state = Mutex(State())

    /// Fetches started so far.
    var fetchCount: Int { state.withLock { $0.requests.count } }

    /// The request of fetch `number` (1-based).
    func request(_ number: Int) -> FetchRequest { state.withLock { $0.requests[number - 1] } }

    func fetch(_ request: FetchRequest) async throws -> FetchedToken {
        try await withCheckedThrowingContinuation { continuation in
            state.withLock { state in
                state.requests.append(request)
                state.parked[state.requests.count] = continuation
            }
        }
    }

    /// Waits (with a deadline) until fetch `number` has started and is parked.
    func started(_ number: Int, sourceLocation: SourceLocation = #_sourceLocation) async throws {
        try await eventually("fetch \(number) started", sourceLocation: sourceLocation) {
            self.state.withLock { $0.parked[number] != nil }
        }
    }

    /// Answers fetch `number` with `token`.
    func succeed(_ number: Int, with token: FetchedToken) {
        take(number)?.resume(returning: token)
    }

    /// Fails fetch `number` with `error`.
    func fail(_ number: Int, with error: any Error) {
        take(number)?.resume(throwing: error)
    }

    private func take(_ number: Int) -> CheckedContinuation<FetchedToken, any Error>? {
        let continuation = state.withLock { $0.parked.removeValue(forKey: number) }
        if continuation == nil { Issue.record("fetch \(number) is not parked") }
        return continuation
    }

    /// A token response numbered `n`: access `access-n`, refresh `refresh-n`.
    static func token(_ n: Int, expiresIn: Duration? = .seconds(3600), rotate: Bool = true) -> FetchedToken {
        FetchedToken(accessToken: Secret("access-\(n)"), tokenType: "Bearer", expiresIn: expiresIn,
                     refreshToken: rotate ? Secret("refresh-\(n)") : nil)
    }
}
