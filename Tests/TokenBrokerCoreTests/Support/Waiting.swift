#if canImport(Glibc)
import Glibc
#endif
import Synchronization
import Testing
import TestSupport
import TokenBrokerCore

/// `count` concurrent callers, each running `body` in its own task; results are collected by
/// index, so a test can wait for all of them with a deadline and cancel single ones.
final class Racers<T: Sendable>: Sendable {
    private final class Results: Sendable {
        let map = Mutex<[Int: Result<T, any Error>]>([:])
    }

    private let results = Results()
    private let tasks: [Task<Void, Never>]

    init(_ count: Int, _ body: @escaping @Sendable (Int) async throws -> T) {
        let results = self.results
        tasks = (0..<count).map { index in
            Task {
                let result: Result<T, any Error>
                do { result = .success(try await body(index)) } catch { result = .failure(error) }
                results.map.withLock { $0[index] = result }
            }
        }
    }

    var finished: Int { results.map.withLock { $0.count } }

    func result(_ index: Int) -> Result<T, any Error>? { results.map.withLock { $0[index] } }

    func cancel(_ index: Int) { tasks[index].cancel() }

    /// Every caller's result, in index order, once all have finished.
    func all(sourceLocation: SourceLocation = #_sourceLocation) async throws -> [Result<T, any Error>] {
        try await eventually("\(tasks.count) callers to finish", sourceLocation: sourceLocation) { [self] in finished == tasks.count }
        return results.map.withLock { results in (0..<tasks.count).map { results[$0]! } }
    }
}

extension Result {
    var value: Success? { try? get() }
    var error: Failure? {
        if case let .failure(error) = self { return error }
        return nil
    }
}

/// Iterations of each race test: `TB_RACE_ITERATIONS` or the CI-sized default.
func raceIterations(_ fallback: Int = 500) -> Int {
    guard let text = getenvString("TB_RACE_ITERATIONS"), let value = Int(text), value > 0 else { return fallback }
    return value
}

func getenvString(_ name: String) -> String? { getenv(name).map { String(cString: $0) } }
