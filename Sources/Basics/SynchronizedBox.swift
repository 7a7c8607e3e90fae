import Synchronization

/// A value behind a lock.
public final class SynchronizedBox<Value: Sendable>: Sendable {
    private let state: Mutex<Value>

    public init(_ value: Value) { state = Mutex(value) }

    /// Changes the value in place, under the lock.
    public func modify<Result>(_ body: (inout Value) -> Result) -> Result {
        state.withLock { body(&$0) }
    }

    public var value: Value {
        get { state.withLock { $0 } }
        set { state.withLock { $0 = newValue } }
    }
}
