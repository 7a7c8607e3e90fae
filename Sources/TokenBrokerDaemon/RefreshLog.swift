import Synchronization
import TokenBrokerCore

/// One journal line per upstream refresh outcome: a new token at info (serial, lifetime,
/// duration), a failure at warning (its class, reason and retry), a session that ends at error,
/// a dropped answer at notice, throttling at warning (rate-limited). With the SESSION= and
/// GENERATION= fields of the other entries; never a token.
struct RefreshLog: Sendable {
    let logger: Logger
    let policy: RefreshPolicy
    /// The lifetime last warned about (one coordinator, one session): said again only when it changes.
    private let warned = Box()

    private final class Box: Sendable {
        let lifetime = Mutex<Duration?>(nil)
    }

    init(logger: Logger, policy: RefreshPolicy) {
        self.logger = logger
        self.policy = policy
    }

    func record(_ outcome: RefreshOutcome) {
        let name = outcome.session
        let took = Self.milliseconds(outcome.duration)
        switch outcome.result {
        case let .refreshed(serial, lifetime):
            logger.log(.info, "session \(name): refreshed, token #\(serial)" + (lifetime.map { ", lifetime \(Self.seconds($0))" } ?? "")
                       + ", in \(took)", session: name, generation: outcome.generation, tokenSerial: serial)
            if let lifetime { warnAboutLifetime(lifetime, session: name) }
        case let .failed(reason, refused, retryAfter):
            logger.log(.warning, "session \(name): refresh failed (\(refused ? "refused" : "transient")): \(reason)"
                       + (retryAfter.map { "; retry in \(Self.seconds($0))" } ?? "") + ", after \(took)",
                       session: name, generation: outcome.generation)
        case let .ended(reason):
            logger.log(.error, "session \(name): ended: \(reason)", session: name, generation: outcome.generation)
        case .dropped:
            logger.log(.notice, "session \(name): a refresh answer was discarded (a logout, login or stop overtook it, "
                       + "or a newer generation was stored), after \(took)",
                       session: name, generation: outcome.generation)
        case let .throttled(retryAfter, demander?):
            // One peer spent its share: said per peer, and only of it (the others still refresh).
            logger.limited(.warning, key: "throttled:\(name):\(demander.uid)",
                           "session \(name): \(demander) has spent its share of refreshes (\(RefreshBudget.share(of: policy.guardLimit)) per "
                           + "RefreshLimitInterval=\(Self.seconds(policy.guardWindow)), half of RefreshLimitBurst=\(policy.guardLimit)): "
                           + "its refreshes are refused for \(Self.seconds(retryAfter)), other callers' are not")
        case let .throttled(retryAfter, nil):
            logger.limited(.warning, key: "throttled:\(name)",
                           "session \(name): refresh limit reached (RefreshLimitBurst=\(policy.guardLimit) per "
                           + "RefreshLimitInterval=\(Self.seconds(policy.guardWindow)), beyond the refreshes the tokens' lifetime needs); "
                           + "next in \(Self.seconds(retryAfter))")
        }
    }

    /// Lifetimes that change how the session refreshes: said once per session and lifetime.
    private func warnAboutLifetime(_ lifetime: Duration, session name: String) {
        let short = lifetime * policy.guardLimit < policy.guardWindow
        let underAhead = policy.refreshAhead > .zero && lifetime < policy.refreshAhead * 2
        guard short || underAhead, warned.lifetime.withLock({ last in
            defer { last = lifetime }
            return last != lifetime
        }) else { return }
        if short {
            // The guard sizes itself (RefreshPolicy.expiryRefreshes); the keys are named so that
            // an operator who wants a tighter bound knows what to set.
            logger.log(.notice, "session \(name): tokens live \(Self.seconds(lifetime)), so the refresh guard allows the "
                           + "\(policy.expiryRefreshes(lifetime: lifetime)) refreshes per \(Self.seconds(policy.guardWindow)) they need, "
                           + "on top of RefreshLimitBurst=\(policy.guardLimit) per RefreshLimitInterval=\(Self.seconds(policy.guardWindow))",
                       session: name)
        } else {
            logger.log(.notice, "session \(name): tokens live \(Self.seconds(lifetime)), less than twice RefreshAhead= "
                           + "(\(Self.seconds(policy.refreshAhead))): each is refreshed half-way through its life instead",
                       session: name)
        }
    }

    static func seconds(_ duration: Duration) -> String {
        let value = duration.seconds
        return value == value.rounded() ? "\(Int64(value))s" : "\((value * 10).rounded() / 10)s"
    }

    static func milliseconds(_ duration: Duration) -> String {
        "\(Int64((duration.seconds * 1000).rounded())) ms"
    }
}
