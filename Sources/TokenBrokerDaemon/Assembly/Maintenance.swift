import Basics
import TokenBrokerCore

/// Once a second: retries the pending writes of degraded sessions (backing off while they keep
/// failing), refreshes ahead for sessions only watchers follow, says what the audit trail left
/// out of the journal, and keeps systemd's STATUS= current. It asks the census, not each session:
/// an idle daemon does no work per session.
struct Maintenance: Sendable {
    let table: SessionTable
    let census: SessionCensus
    let reloader: Reloader
    let logger: Logger
    /// Says, each second, how many audit records each peer had left out of the journal.
    var audit: Audit?

    func run(until stop: Latch) async {
        var delay = Duration.seconds(1)
        var nextFlush = ContinuousClock.now + delay
        var lastStatus = ""
        while !Task.isCancelled, !(await stop.wait(upTo: .seconds(1))) {
            if ContinuousClock.now >= nextFlush {
                var allFlushed = true
                let degraded = census.degradedSessions
                if !degraded.isEmpty {
                    let sessions = table.snapshot.sessions
                    for name in degraded {
                        guard let session = sessions[name] else { continue }
                        if await session.coordinator.flushPendingWrite() {
                            logger.notice("session \(name): pending state written; no longer degraded", session: name)
                        } else {
                            allFlushed = false
                        }
                    }
                }
                if await !reloader.flushRemoved() { allFlushed = false }
                delay = allFlushed ? .seconds(1) : min(delay * 2, .seconds(60))
                nextFlush = ContinuousClock.now + delay
            }
            // Sessions followed only by watchers get their refresh-ahead here: no demand would
            // start it otherwise.
            let watched = census.watchedSessions
            if !watched.isEmpty {
                let sessions = table.snapshot.sessions
                for name in watched { await sessions[name]?.coordinator.prefetch() }
            }
            audit?.flushSuppressed()
            let status = statusLine()
            if status != lastStatus {
                Systemd.status(status)
                lastStatus = status
            }
        }
    }

    /// One line for systemd's STATUS=: sessions by state, degraded ones, the last refresh.
    func statusLine() -> String {
        let totals = census.totals
        var line = "\(totals.active) active, \(totals.signedOut) signed out, \(totals.ended) failed, \(totals.degraded) degraded"
        if let lastRefresh = totals.lastRefresh { line += "; last refresh \(UTCTime.timeOfDay(lastRefresh)) UTC" }
        if let problem = reloader.problem.value { line += "; reload failed: \(problem)" }
        return line
    }
}
