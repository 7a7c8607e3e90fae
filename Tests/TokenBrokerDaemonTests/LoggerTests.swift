import Testing
@testable import TokenBrokerDaemon

@Suite("Logger")
struct LoggerTests {
    @Test("a message is one line whatever it carries: CR, LF, NEL, DEL, U+2028/2029 and other controls are escaped; length is bounded")
    func printable() {
        let forged = "GetToken by pid 1 uid 1000\r\n<3>forged entry\r<4>another\u{85}x\u{2028}y\u{2029}z\u{7F}\u{1B}[31m\u{0}"
        let line = Logger.printable(forged)
        #expect(!line.unicodeScalars.contains { $0.value < 0x20 || (0x7F...0x9F).contains($0.value) || $0.value == 0x2028 || $0.value == 0x2029 })
        #expect(line == #"GetToken by pid 1 uid 1000\x0d\x0a<3>forged entry\x0d<4>another\x85x\u{2028}y\u{2029}z\x7f\x1b[31m\x00"#)
        #expect(Logger.printable("é ✓ plain") == "é ✓ plain")
        let long = Logger.printable(String(repeating: "k", count: 100_000))
        #expect(long.utf8.count <= 2048 + 3 && long.hasSuffix("…"))
    }

    @Test("rate limit: a burst per key per interval, then silence, then one entry saying how many were left out")
    func rateLimit() {
        var limiter = Logger.RateLimiter(burst: 3, interval: .seconds(10), maximumKeys: 4)
        let start = ContinuousClock.now
        #expect((0..<5).map { _ in limiter.admit("uid 7", now: start) } == [0, 0, 0, nil, nil])
        #expect(limiter.admit("uid 8", now: start) == 0)   // another peer is not silenced by the first
        #expect(limiter.admit("uid 7", now: start + .seconds(10)) == 2)
        // Many distinct keys (an attacker with many uids, say) do not grow the table without bound.
        for key in 0..<100 { _ = limiter.admit("uid \(1000 + key)", now: start + .seconds(11)) }
        #expect(limiter.admit("uid 5000", now: start + .seconds(11)) == nil)
    }
}
