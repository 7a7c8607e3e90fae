/// Runs `body` to its end in a task of its own and returns what it returns: the caller's
/// cancellation does not reach it. For work that must land once begun (a commit to etcd, a
/// boundary published to a fleet), whoever waited for it goes away.
public func uncancelled<Value: Sendable>(_ body: @escaping @Sendable () async -> Value) async -> Value {
    await Task { await body() }.value
}
