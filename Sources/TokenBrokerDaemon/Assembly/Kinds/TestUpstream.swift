import TokenBrokerCore
import Upstream

/// `Upstream=test`: tokens made in the daemon, no credential (demos, benchmarks, tests).
struct TestUpstream: SessionKind {
    let lifetime: Duration

    func source(for session: SessionConfiguration, in factory: SessionFactory) -> (source: any TokenSource, upstream: HTTPTokenSource?) {
        (TestTokenSource(lifetime: lifetime), nil)
    }

    var logsInAtStart: Bool { true }

    var interactiveLogin: InteractiveLoginOffer { .none("this session has no OAuth upstream") }

    var revokesAtLogout: Bool { false }

    var longestFlight: Duration { .zero }
}
