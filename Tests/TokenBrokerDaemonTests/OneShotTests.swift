import Basics
import Testing

/// The one-shot value under the latches and a code login's answer and result.
@Suite("OneShot")
struct OneShotTests {
    @Test("the first value is the one every waiter gets; a closed shot takes none and tells its waiters nil; a cancelled waiter gets nil (issue 34)")
    func oneShot() async {
        let shot = OneShot<Int>()
        let early = Task { await shot.wait() }
        #expect(shot.set(1))
        #expect(!shot.set(2), "a second value is refused")
        #expect(await early.value == 1 && shot.value == 1)
        #expect(await shot.wait() == 1, "and at once after")
        #expect(shot.close() == 1, "closing keeps the value it had")

        let empty = OneShot<String>()
        let waiting = Task { await empty.wait() }
        #expect(await empty.wait(upTo: .milliseconds(10)) == nil)
        #expect(empty.close() == nil)
        #expect(await waiting.value == nil, "closed without a value: nil")
        #expect(!empty.set("late"), "closed: nothing is taken")

        let open = OneShot<String>()
        let cancelled = Task { await open.wait() }
        cancelled.cancel()
        #expect(await cancelled.value == nil)
        #expect(open.set("after"), "a cancelled waiter changes nothing")
    }
}
