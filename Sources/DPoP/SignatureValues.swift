#if canImport(Glibc)
import Glibc
#endif
import Basics
import CCrypto
import Synchronization

/// ES256's per-signature values made ahead: k⁻¹ and r = (kG).x for a random k, the scalar
/// multiplication that is most of a signature's cost. A proof then costs a few modular
/// multiplications on the caller's thread (the varlink loop's, for GetProof).
///
/// - Each value signs once: `take()` removes it, and its numbers are cleared when it is freed.
///   (Reusing a k would give the key away.)
/// - They depend on the curve only, not on a key: one pool serves every P-256 key.
/// - At most `capacity` are kept (a few KiB); a thread of their own makes more once the pool is
///   below half, at the lowest priority there is (SCHED_IDLE, else nice 19): it runs when
///   nothing else wants the CPU, and does not delay a call. A pool that is empty when a proof is wanted is no
///   failure: that signature makes its own value, as it would without the pool.
/// - The thread starts at the first `take()`: a daemon that signs no proof never makes one.
public final class SignatureValues: Sendable {
    /// One value (k⁻¹, r): used once, then cleared and freed.
    final class Value: @unchecked Sendable {
        // @unchecked: the two numbers are only read, by the one signature that took the value,
        // and freed (cleared) when it is gone.
        let kinv: OpaquePointer
        let r: OpaquePointer

        init(kinv: OpaquePointer, r: OpaquePointer) { (self.kinv, self.r) = (kinv, r) }

        deinit {
            BN_clear_free(kinv)
            BN_clear_free(r)
        }
    }

    /// The values ready, and whether the maker is asked for more.
    private struct State {
        var ready: [Value] = []
        var started = false
        var asked = false
        var made = 0
        var taken = 0
    }

    /// The process's pool.
    public static let shared = SignatureValues(capacity: 64)

    public let capacity: Int
    private let state = Mutex(State())
    /// Wakes the maker thread.
    private let wanted = Semaphore()

    public init(capacity: Int) {
        self.capacity = max(capacity, 2)
    }

    /// A value to sign with, or nil when none is ready (the signature then makes its own).
    func take() -> Value? {
        let (value, start, ask) = state.withLock { state -> (Value?, Bool, Bool) in
            let value = state.ready.popLast()
            if value != nil { state.taken += 1 }
            let start = !state.started
            state.started = true
            let ask = !state.asked && state.ready.count <= capacity / 2
            if ask { state.asked = true }
            return (value, start, ask)
        }
        if start { startMaker() }
        if ask { wanted.signal() }
        return value
    }

    /// Values made and taken so far, and how many are ready (for tests and the bench).
    public var counts: (made: Int, taken: Int, ready: Int) {
        state.withLock { ($0.made, $0.taken, $0.ready.count) }
    }

    private func startMaker() {
        // (The pool lives as long as the process: `shared`, or a test's, which it leaks.)
        spawnThread { [self] in
            // SCHED_IDLE (5): runs only on a CPU nothing else wants (sched(7)). Where the system
            // call is filtered (the shipped unit denies @resources), nice 19 instead: setpriority
            // is allowed, and a thread may always lower its own priority (who 0: this thread, on Linux).
            var parameters = sched_param(sched_priority: 0)
            if sched_setscheduler(0, 5, &parameters) != 0 { _ = setpriority(__priority_which_t(PRIO_PROCESS.rawValue), 0, 19) }
            guard let key = tb_ecdsa_new_p256() else { return }
            defer { tb_ecdsa_free_key(key) }
            while true {
                wanted.wait()
                while true {
                    let full = state.withLock { state -> Bool in
                        guard state.ready.count < capacity else {
                            state.asked = false
                            return true
                        }
                        return false
                    }
                    if full { break }
                    var kinv: OpaquePointer?
                    var r: OpaquePointer?
                    guard tb_ecdsa_setup(key, &kinv, &r) == 1, let kinv, let r else {
                        BN_clear_free(kinv)
                        BN_clear_free(r)
                        ERR_clear_error()
                        state.withLock { $0.asked = false }
                        break
                    }
                    let value = Value(kinv: kinv, r: r)
                    state.withLock { state in
                        state.ready.append(value)
                        state.made += 1
                    }
                }
            }
        }
    }
}
