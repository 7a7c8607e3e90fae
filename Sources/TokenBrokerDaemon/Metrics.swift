import Basics
import BrokerContract
import Fleet
import Synchronization
import TokenBrokerCore

/// The daemon's metrics, for Prometheus (`MetricsListen=`, `ctl metrics`).
///
/// The hot path (a GetToken answered from the snapshot) costs one relaxed atomic increment;
/// everything else (refresh outcomes, store writes, reloads, refused connections) is rare and
/// kept under a lock. Per-session figures live here, not in the coordinators, so they survive a
/// reload that replaces a coordinator. Labels are session names (`[A-Za-z0-9._-]`) and fixed
/// words only: never a token, secret or client id.
final class Metrics: Sendable {
    /// One counter, bumped without a lock.
    final class Counter: Sendable {
        private let value = Atomic<Int>(0)
        func add(_ amount: Int = 1) { value.add(amount, ordering: .relaxed) }
        var count: Int { value.load(ordering: .relaxed) }
    }

    /// The calls counted by result: those that answer a token.
    static let tokenMethods: [BrokerMethod] = [.getToken, .recover, .getProof, .credential]

    /// The results a token call can have: `ok`, `cancelled` (the caller went away
    /// before the answer), or the contract error's name.
    static let callResults = ["ok", "cancelled"] + BrokerError.tokenCallErrors.map(\.name) + ["InvalidParameter", "other"]

    /// The token calls by method and result; the dictionaries are built once and only read after.
    private let calls: [BrokerMethod: [String: Counter]]
    /// The hot path's own counter (a dictionary lookup saved).
    let getTokenOK: Counter

    struct Histogram: Sendable {
        let bounds: [Double]
        var counts: [Int]
        var sum = 0.0
        var count = 0

        init(bounds: [Double]) {
            self.bounds = bounds
            counts = Array(repeating: 0, count: bounds.count)
        }

        mutating func observe(_ value: Double) {
            for (index, bound) in bounds.enumerated() where value <= bound { counts[index] += 1 }
            sum += value
            count += 1
        }
    }

    private struct SessionFigures: Sendable {
        var refreshes: [String: Int] = [:]
        var upstream = Histogram(bounds: [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60])
    }

    private struct Rare: Sendable {
        var sessions: [String: SessionFigures] = [:]
        var storeWrites = Histogram(bounds: [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5])
        var storeFailures = 0
        var reloads: [String: Int] = ["ok": 0, "failed": 0]
        var refusedConnections: [String: Int] = Dictionary(uniqueKeysWithValues: Metrics.connectionRefusals.map { ($0, 0) })
        var tokenFileWrites: [String: Int] = ["ok": 0, "failed": 0]
        var refusedScrapes: [String: Int] = [:]
    }

    private let rare = Mutex(Rare())
    let version: String

    init(version: String) {
        self.version = version
        var calls: [BrokerMethod: [String: Counter]] = [:]
        for method in Self.tokenMethods {
            calls[method] = Dictionary(uniqueKeysWithValues: Self.callResults.map { ($0, Counter()) })
        }
        self.calls = calls
        getTokenOK = calls[.getToken]!["ok"]!
    }

    // MARK: - Recording

    /// A token call's result: `error` is the reply's error name (nil: a token).
    func call(_ method: BrokerMethod, error: String?) {
        guard let table = calls[method] else { return }
        let result = error.map { name in String(name[(name.lastIndex(of: ".").map { name.index(after: $0) } ?? name.startIndex)...]) } ?? "ok"
        (table[result] ?? table["other"])?.add()
    }

    func record(_ outcome: RefreshOutcome) {
        let label = outcome.result.label
        var timed = true
        if case .throttled = outcome.result { timed = false }
        let seconds = outcome.duration.seconds
        rare.withLock { rare in
            rare.sessions[outcome.session, default: SessionFigures()].refreshes[label, default: 0] += 1
            if timed { rare.sessions[outcome.session, default: SessionFigures()].upstream.observe(seconds) }
        }
    }

    func storeWrite(seconds: Double, failed: Bool) {
        rare.withLock { rare in
            rare.storeWrites.observe(seconds)
            if failed { rare.storeFailures += 1 }
        }
    }

    func reload(ok: Bool) {
        rare.withLock { $0.reloads[ok ? "ok" : "failed", default: 0] += 1 }
    }

    /// Why a connection was refused: the server full, a user's share of it, no descriptors
    /// left, a delegation's MaxConnections= reached.
    static let connectionRefusals = ["server_full", "user_limit", "descriptors", "delegation_full"]

    /// A token file written (or not: a write that failed).
    func tokenFileWrite(failed: Bool) {
        rare.withLock { $0.tokenFileWrites[failed ? "failed" : "ok", default: 0] += 1 }
    }

    func refusedConnection(_ reason: String) {
        rare.withLock { $0.refusedConnections[reason, default: 0] += 1 }
    }

    /// A scrape not answered in full: forbidden, unauthorized, busy, timeout, full.
    func refusedScrape(_ reason: String) {
        rare.withLock { $0.refusedScrapes[reason, default: 0] += 1 }
    }

    static let scrapeRefusals = ["forbidden", "unauthorized", "busy", "timeout", "full"]

    // MARK: - The exposition

    /// What a scrape shows of one session, read from its coordinator.
    struct SessionView: Sendable {
        var status: SessionStatus
        var fleet: DaemonFleetSession.Status?
        /// A derived session's parent (`DerivedFrom=`).
        var parent: String?
        /// Its keys asked for call by call, held now and dropped beyond `MaxKeys=` so far.
        var keys: (live: Int, evicted: Int)?
    }

    /// The exposition: the Prometheus text format (0.0.4), or OpenMetrics 1.0.0. Without
    /// `full`, only the daemon-wide series: nothing that names a session or shows its callers'
    /// activity (for a scraper that has not shown it may see them).
    func render(sessions: [SessionView], connections: Int, unixNow: Int64, openMetrics: Bool, full: Bool = true,
                audit: (records: Int, suppressed: Int) = (0, 0)) -> String {
        var out = Exposition(openMetrics: openMetrics)
        let rare = self.rare.withLock { $0 }
        out.family("tokenbroker_build", "gauge", "The daemon's version.", info: true)
        out.sample("tokenbroker_build_info", ["version": version], 1)
        out.family("tokenbroker_metrics_scrapes_refused", "counter", "Scrapes of /metrics not answered in full, by reason.")
        for reason in Self.scrapeRefusals {
            out.sample("tokenbroker_metrics_scrapes_refused_total", ["reason": reason], Double(rare.refusedScrapes[reason] ?? 0))
        }
        guard full else {
            daemonWide(&out, rare, connections: connections, audit: audit)
            return out.finish()
        }

        out.family("tokenbroker_calls", "counter", "GetToken, Recover, GetProof and Credential calls by result (ok, or the error's name).")
        for method in Self.tokenMethods {
            let table = calls[method] ?? [:]
            for result in Self.callResults {
                out.sample("tokenbroker_calls_total", ["method": method.rawValue, "result": result], Double(table[result]?.count ?? 0))
            }
        }

        let names = sessions.map(\.status.name)
        out.family("tokenbroker_refreshes", "counter", "Upstream refreshes by session and outcome.")
        for name in names {
            let counts = rare.sessions[name]?.refreshes ?? [:]
            for outcome in RefreshOutcome.Result.labels {
                out.sample("tokenbroker_refreshes_total", ["session": name, "outcome": outcome], Double(counts[outcome] ?? 0))
            }
        }
        out.family("tokenbroker_upstream_request_duration_seconds", "histogram", "Duration of upstream token requests (refreshes).")
        for name in names {
            out.histogram("tokenbroker_upstream_request_duration_seconds", ["session": name], rare.sessions[name]?.upstream ?? SessionFigures().upstream)
        }

        out.family("tokenbroker_joined_waiters", "counter", "Demands that joined a refresh another demand had started.")
        // (A coordinator a reload replaces hands its counters to its successor.)
        for view in sessions {
            out.sample("tokenbroker_joined_waiters_total", ["session": view.status.name], Double(view.status.counters.joinedWaiters))
        }
        out.family("tokenbroker_stale_rejections", "counter", "Recover calls whose rejected token was no longer current.")
        for view in sessions {
            out.sample("tokenbroker_stale_rejections_total", ["session": view.status.name], Double(view.status.counters.staleRejections))
        }
        out.family("tokenbroker_session_state", "gauge", "1 for the state each session is in.")
        for view in sessions {
            for state in [SessionState.active, .signedOut, .ended] {
                out.sample("tokenbroker_session_state", ["session": view.status.name, "state": state.rawValue], view.status.state == state ? 1 : 0)
            }
        }
        out.family("tokenbroker_token_expiry_seconds", "gauge", "Seconds until the current access token expires (absent without one).")
        for view in sessions {
            guard let expiresAt = view.status.expiresAt, view.status.tokenSerial != nil else { continue }
            out.sample("tokenbroker_token_expiry_seconds", ["session": view.status.name], Double(expiresAt - unixNow))
        }
        out.family("tokenbroker_session_degraded", "gauge", "1 while a session is served from memory (a state write failed) or its fleet is unavailable.")
        for view in sessions {
            var degraded = view.status.degraded
            switch view.fleet?.health {
            case .unavailable?, .untrusted?: degraded = true
            case .healthy?, .starting?, nil: break
            }
            out.sample("tokenbroker_session_degraded", ["session": view.status.name], degraded ? 1 : 0)
        }
        let derived = sessions.filter { $0.parent != nil }
        if !derived.isEmpty {
            out.family("tokenbroker_derived_session", "gauge", "Derived sessions (DerivedFrom=) and the session each derives its tokens from.", info: true)
            for view in derived { out.sample("tokenbroker_derived_session_info", ["session": view.status.name, "parent": view.parent ?? ""], 1) }
        }
        let keyed = sessions.filter { $0.keys != nil }
        if !keyed.isEmpty {
            out.family("tokenbroker_derived_keys", "gauge", "Keys (resource, scope) callers narrowed the session's token to, held now.")
            for view in keyed { out.sample("tokenbroker_derived_keys", ["session": view.status.name], Double(view.keys?.live ?? 0)) }
            out.family("tokenbroker_derived_keys_evicted", "counter", "Keys dropped to stay within MaxKeys= (the least recently used).")
            for view in keyed { out.sample("tokenbroker_derived_keys_evicted_total", ["session": view.status.name], Double(view.keys?.evicted ?? 0)) }
        }
        let fleet = sessions.filter { $0.fleet != nil }
        if !fleet.isEmpty {
            out.family("tokenbroker_fleet_healthy", "gauge", "1 while the fleet's etcd answers and its state is trusted (fleet sessions only).")
            for view in fleet {
                var healthy = false
                if case .healthy = view.fleet?.health { healthy = true }
                out.sample("tokenbroker_fleet_healthy", ["session": view.status.name], healthy ? 1 : 0)
            }
            out.family("tokenbroker_fleet_refused_values", "counter",
                       "Values read from etcd that were not taken: not sealed with the fleet key, altered, or written back (each write once).")
            for view in fleet {
                out.sample("tokenbroker_fleet_refused_values_total", ["session": view.status.name], Double(view.fleet?.counters.refusedValues ?? 0))
            }
            out.family("tokenbroker_fleet_rollbacks", "counter", "Times etcd showed older history than this broker had seen (not followed).")
            for view in fleet {
                out.sample("tokenbroker_fleet_rollbacks_total", ["session": view.status.name], Double(view.fleet?.counters.rollbacks ?? 0))
            }
            out.family("tokenbroker_fleet_watch_restarts", "counter", "Watches of the fleet's keys started again after one ended early or failed.")
            for view in fleet {
                out.sample("tokenbroker_fleet_watch_restarts_total", ["session": view.status.name], Double(view.fleet?.counters.watchRestarts ?? 0))
            }
        }

        daemonWide(&out, rare, connections: connections, audit: audit)
        return out.finish()
    }

    /// The series that name no session.
    private func daemonWide(_ out: inout Exposition, _ rare: Rare, connections: Int, audit: (records: Int, suppressed: Int)) {
        out.family("tokenbroker_connections_open", "gauge", "Client connections open now.")
        out.sample("tokenbroker_connections_open", [:], Double(connections))
        out.family("tokenbroker_connections_refused", "counter", "Connections refused, by reason.")
        for reason in Self.connectionRefusals {
            out.sample("tokenbroker_connections_refused_total", ["reason": reason], Double(rare.refusedConnections[reason] ?? 0))
        }
        out.family("tokenbroker_store_write_duration_seconds", "histogram", "Duration of state writes (fsync included).")
        out.histogram("tokenbroker_store_write_duration_seconds", [:], rare.storeWrites)
        out.family("tokenbroker_store_write_failures", "counter", "State writes that failed.")
        out.sample("tokenbroker_store_write_failures_total", [:], Double(rare.storeFailures))
        out.family("tokenbroker_reloads", "counter", "Configuration reloads by result.")
        for result in ["ok", "failed"] { out.sample("tokenbroker_reloads_total", ["result": result], Double(rare.reloads[result] ?? 0)) }
        out.family("tokenbroker_token_file_writes", "counter", "Token files written ([Output], ctl delegate --file), by result.")
        for result in ["ok", "failed"] {
            out.sample("tokenbroker_token_file_writes_total", ["result": result], Double(rare.tokenFileWrites[result] ?? 0))
        }
        out.family("tokenbroker_audit_records", "counter", "Audit records: a token handed to a peer for the first time (ctl audit).")
        out.sample("tokenbroker_audit_records_total", [:], Double(audit.records))
        out.family("tokenbroker_audit_suppressed", "counter", "Audit records left out of the journal (beyond a peer's share per interval).")
        out.sample("tokenbroker_audit_suppressed_total", [:], Double(audit.suppressed))
    }
}

/// Writes the text of an exposition.
struct Exposition {
    let openMetrics: Bool
    private var text = ""

    init(openMetrics: Bool) { self.openMetrics = openMetrics }

    /// A family's metadata. Prometheus' text format names counters with their `_total`
    /// suffix and has no info type; OpenMetrics names the family without it.
    mutating func family(_ name: String, _ type: String, _ help: String, info: Bool = false) {
        var family = name
        var kind = type
        if openMetrics {
            if info { kind = "info" }
        } else {
            if type == "counter" { family += "_total" }
            if info { family += "_info" }
        }
        text += "# HELP \(family) \(help)\n# TYPE \(family) \(kind)\n"
    }

    mutating func sample(_ name: String, _ labels: [String: String], _ value: Double) {
        text += name
        if !labels.isEmpty {
            text += "{" + labels.sorted { $0.key < $1.key }.map { "\($0.key)=\"\(Self.escape($0.value))\"" }.joined(separator: ",") + "}"
        }
        text += " " + Self.number(value) + "\n"
    }

    mutating func histogram(_ name: String, _ labels: [String: String], _ histogram: Metrics.Histogram) {
        for (bound, count) in zip(histogram.bounds, histogram.counts) {
            // OpenMetrics wants canonical numbers for `le`: 1.0, not 1.
            let le = openMetrics && bound == bound.rounded() ? Self.number(bound) + ".0" : Self.number(bound)
            sample(name + "_bucket", labels.merging(["le": le]) { $1 }, Double(count))
        }
        sample(name + "_bucket", labels.merging(["le": "+Inf"]) { $1 }, Double(histogram.count))
        sample(name + "_sum", labels, histogram.sum)
        sample(name + "_count", labels, Double(histogram.count))
    }

    func finish() -> String { openMetrics ? text + "# EOF\n" : text }

    static func number(_ value: Double) -> String {
        if value == value.rounded(), abs(value) < 1e15 { return String(Int64(value)) }
        return "\(value)"
    }

    /// Label values: backslash, double quote and newline escaped (session names never need it).
    static func escape(_ value: String) -> String {
        var escaped = ""
        for character in value {
            switch character {
            case "\\": escaped += "\\\\"
            case "\"": escaped += "\\\""
            case "\n": escaped += "\\n"
            default: escaped.append(character)
            }
        }
        return escaped
    }
}

extension RefreshOutcome.Result {
    /// Every value of the `outcome` label of `tokenbroker_refreshes_total`, in order.
    static let labels = ["ok", "transient", "refused", "terminal", "throttled", "dropped"]

    /// This outcome's label (one of `labels`).
    var label: String {
        switch self {
        case .refreshed: "ok"
        case let .failed(_, refused, _): refused ? "refused" : "transient"
        case .ended: "terminal"
        case .throttled: "throttled"
        case .dropped: "dropped"
        }
    }
}
