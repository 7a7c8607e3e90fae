import Basics
import Synchronization
import Testing

/// The pool that owns the daemon's tasks that outlive their callers: bounded, closed at stop,
/// every task awaited or cancelled. Driven by latches, not sleeps.
@Suite("TaskPool")
struct TaskPoolTests {
    @Test("at most `limit` tasks run; a full or closed pool refuses; close waits for the running ones")
    func boundedAndAwaited() async {
        let pool = TaskPool(limit: 2)
        let release = Latch()
        let started = Mutex(0)
        let ended = Mutex(0)
        for _ in 0..<2 {
            #expect(pool.spawn {
                started.withLock { $0 += 1 }
                await release.wait()
                ended.withLock { $0 += 1 }
            } != nil)
        }
        #expect(pool.spawn {} == nil, "a third task is refused while two run")
        #expect(pool.count == 2)
        let closed = Latch()
        let closing = Task {
            #expect(await pool.close(within: .seconds(60)))
            closed.fire()
        }
        #expect(await closed.wait(upTo: .milliseconds(200)) == false, "close returned while tasks still ran")
        #expect(pool.spawn {} == nil, "a closing pool refuses work")
        release.fire()
        #expect(await closed.wait(upTo: .seconds(10)), "close did not return once the tasks ended")
        await closing.value
        #expect(ended.withLock { $0 } == 2 && pool.count == 0)
    }

    @Test("tasks still running at the deadline are cancelled, and close returns once they end")
    func cancelledAtTheDeadline() async {
        let pool = TaskPool(limit: 4)
        let sawCancellation = Mutex(false)
        pool.spawn {
            // Runs until cancelled (bounded: the test fails rather than hangs if it never is).
            let never = Latch()
            _ = await never.wait(upTo: .seconds(30))
            sawCancellation.withLock { $0 = Task.isCancelled }
        }
        let start = ContinuousClock.now
        #expect(await pool.close(within: .milliseconds(50)))
        #expect(sawCancellation.withLock { $0 })
        #expect(start.duration(to: .now) < .seconds(20))
    }

    @Test("a task that ignores cancellation is left behind after the grace, and close says so")
    func ignoringCancellation() async {
        let pool = TaskPool(limit: 1)
        let release = Latch()
        pool.spawn {
            // Ignores cancellation: waits on a latch whose wait cannot be cancelled away early.
            while !release.hasFired { _ = await release.wait(upTo: .milliseconds(20)) }
        }
        #expect(await pool.close(within: .milliseconds(10), grace: .milliseconds(100)) == false)
        release.fire()
    }

    @Test("enqueued work waits its turn, oldest first, and close drains the backlog before it returns")
    func backlog() async {
        let pool = TaskPool(limit: 1, backlog: 3)
        let release = Latch()
        let order = Mutex<[Int]>([])
        #expect(pool.enqueue { await release.wait(); order.withLock { $0.append(0) } })
        for index in 1...3 { #expect(pool.enqueue { order.withLock { $0.append(index) } }) }
        #expect(!pool.enqueue {}, "the backlog holds three")
        #expect(order.withLock { $0 }.isEmpty && pool.count == 1)
        release.fire()
        #expect(await pool.close(within: .seconds(10)))
        #expect(order.withLock { $0 } == [0, 1, 2, 3])
        #expect(!pool.enqueue {}, "a closed pool takes nothing")
    }

    @Test("outliving: the work runs to its end though its caller is cancelled, and the caller gets its result; a closed pool answers refused, evaluated only then (issue 34)")
    func outliving() async {
        let pool = TaskPool(limit: 1, backlog: 1)
        let started = Latch(), release = Latch()
        let caller = Task {
            await pool.outliving({ () -> String in
                started.fire()
                await release.wait()            // (a cancelled caller does not cancel this)
                return Task.isCancelled ? "cancelled" : "done"
            }, refused: "refused")
        }
        #expect(await started.wait(upTo: .seconds(10)))
        caller.cancel()
        release.fire()
        #expect(await caller.value == "done")
        let evaluated = Mutex(0)
        #expect(await pool.outliving({ "ran" }, refused: { evaluated.withLock { $0 += 1 }; return "refused" }()) == "ran")
        #expect(evaluated.withLock { $0 } == 0, "refused is not evaluated when the work runs")
        #expect(await pool.close(within: .seconds(10)))
        #expect(await pool.outliving({ "ran" }, refused: "refused") == "refused")
    }
}
