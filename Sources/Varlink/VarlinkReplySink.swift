/// Where an async call sends its replies. Safe to use from any task; replies after the call
/// has ended, or for a connection that has closed, are dropped.
public final class VarlinkReplySink: Sendable {
    /// Receives each reply, then `nil` when the call's task has returned.
    private let deliver: @Sendable (VarlinkReply?) -> Void

    /// A sink that hands replies to `deliver` (the server's, or a test's).
    public init(_ deliver: @escaping @Sendable (VarlinkReply?) -> Void) {
        self.deliver = deliver
    }

    /// Sends a reply; for a `more` call, set `continues` on all but the last.
    public func send(_ reply: VarlinkReply) {
        deliver(reply)
    }

    /// Marks the call finished (the server does this when the handler's task returns).
    public func finish() {
        deliver(nil)
    }
}
