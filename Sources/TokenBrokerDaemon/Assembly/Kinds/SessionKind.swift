import TokenBrokerCore
import Upstream

/// A kind of session: where its tokens come from, and whether it needs a login. One type per
/// upstream kind and grant, each in its own file; `SessionFactory.kind(of:)` is the one place
/// that chooses among them.
protocol SessionKind: Sendable {
    /// The session's token source, and the OAuth source behind it if there is one (for
    /// revocation, device logins, discovery).
    func source(for session: SessionConfiguration, in factory: SessionFactory) -> (source: any TokenSource, upstream: HTTPTokenSource?)

    /// A session with nothing stored logs in at start: its credential is the configuration.
    var logsInAtStart: Bool { get }
}
