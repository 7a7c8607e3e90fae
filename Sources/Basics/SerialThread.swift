#if canImport(Glibc)
import Glibc
#endif
import Synchronization

/// A thread that runs submitted jobs one at a time, in order (for blocking work such as
/// database commits, kept off the cooperative pool).
public final class SerialThread: Sendable {
    /// What the thread and the submitters share (the thread must not hold on to `self`, whose
    /// deinit ends it).
    private final class Queue: Sendable {
        /// The jobs not yet taken (from `head` on); `nil` ends the thread.
        let jobs = Mutex<(list: [(@Sendable () -> Void)?], head: Int)>(([], 0))
        /// Counts the jobs submitted and not yet taken: the thread sleeps on it.
        let available = Semaphore()
    }

    private let queue = Queue()

    public init() {
        let queue = self.queue
        spawnThread {
            while true {
                queue.available.wait()
                // (Taken from the head in constant time: thousands may be queued at once.)
                guard let job = queue.jobs.withLock({ jobs -> (@Sendable () -> Void)? in
                    let job = jobs.list[jobs.head]
                    jobs.list[jobs.head] = nil
                    jobs.head += 1
                    if jobs.head == jobs.list.count {
                        jobs.list.removeAll(keepingCapacity: jobs.list.count <= 1024)
                        jobs.head = 0
                    } else if jobs.head >= 1024, jobs.head * 2 >= jobs.list.count {
                        jobs.list.removeFirst(jobs.head)
                        jobs.head = 0
                    }
                    return job
                }) else { return }
                job()
            }
        }
    }

    /// The thread ends once the jobs submitted so far have run.
    deinit { enqueue(nil) }

    public func submit(_ job: @escaping @Sendable () -> Void) {
        enqueue(job)
    }

    private func enqueue(_ job: (@Sendable () -> Void)?) {
        queue.jobs.withLock { $0.list.append(job) }
        queue.available.signal()
    }

    /// Runs `job` on the thread and returns its result to the awaiting task.
    public func run<T: Sendable>(_ job: @escaping @Sendable () throws -> T) async throws -> T {
        try await withCheckedThrowingContinuation { continuation in
            submit { continuation.resume(with: Result { try job() }) }
        }
    }
}

/// A counting semaphore (POSIX), for a thread that sleeps until there is work.
public final class Semaphore: @unchecked Sendable {
    // @unchecked: sem_wait and sem_post are thread-safe; the storage is allocated once and
    // never moves or changes otherwise.
    private let storage = UnsafeMutablePointer<sem_t>.allocate(capacity: 1)

    public init() { sem_init(storage, 0, 0) }

    deinit {
        sem_destroy(storage)
        storage.deallocate()
    }

    public func wait() { while sem_wait(storage) != 0 && errno == EINTR {} }
    public func signal() { sem_post(storage) }
}
