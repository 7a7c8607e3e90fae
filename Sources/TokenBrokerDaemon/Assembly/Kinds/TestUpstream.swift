import TokenBrokerCore
import Upstream

/// `Upstream=test`: tokens made in the daemon, no credential (demos, benchmarks, tests).
struct TestUpstream: SessionKind {
    let lifetime: Duration

    func source(for session: SessionConfiguration, in factory: SessionFactory) -> (source: any TokenSource, account: (any UpstreamAccount)?) {
        (TestTokenSource(lifetime: lifetime), nil)
    }

    var logsInAtStart: Bool { true }

    var interactiveLogin: InteractiveLoginOffer { .none("this session has no OAuth upstream") }

    var revokesAtLogout: Bool { false }

    var longestFlight: Duration { .zero }

    /// No interactive login serves it; it takes any refresh token.
    func wayBackIn(_ session: String) -> String? { "printf x | tokenbroker ctl login \(session) --refresh-token-stdin" }
}
