#if canImport(Glibc)
import Glibc
#endif

/// Starts a detached POSIX thread that runs `body` (for I/O loops that must not live in the
/// cooperative pool).
public func spawnThread(_ body: @escaping @Sendable () -> Void) {
    final class Box: Sendable {
        let body: @Sendable () -> Void
        init(_ body: @escaping @Sendable () -> Void) { self.body = body }
    }
    let context = Unmanaged.passRetained(Box(body)).toOpaque()
    var thread = pthread_t()
    let rc = pthread_create(&thread, nil, { context in
        Unmanaged<Box>.fromOpaque(context!).takeRetainedValue().body()
        return nil
    }, context)
    precondition(rc == 0, "pthread_create failed: \(rc)")
    pthread_detach(thread)
}
