#if canImport(Glibc)
import Glibc
#endif
import Basics
import TokenBrokerCore
import Varlink

/// Who may read what of the exposition (`MetricsGroup=`, `MetricsBearerTokenFile=`).
struct MetricsAuthorization: Sendable {
    /// Whether a peer on a Unix socket may read the per-session series (admins, `MetricsGroup=`).
    var peerMayRead: @Sendable (PeerCredentials) -> Bool
    /// The bearer token a scraper must present for the per-session series (TCP or Unix).
    var bearerToken: Secret?

    /// What a request may see: the whole exposition, the daemon-wide part, or nothing.
    enum View: Equatable { case full, daemonOnly, forbidden, unauthorized }

    func view(peer: PeerCredentials?, authorization: String?) -> View {
        if let bearerToken, let authorization, authorization.count > 7, authorization.prefix(7).lowercased() == "bearer ",
           Self.constantTimeEqual(Array(authorization.utf8.dropFirst(7)), Array(bearerToken.reveal.utf8)) {
            return .full
        }
        if let peer { return peerMayRead(peer) ? .full : .forbidden }
        // TCP: session names only to a scraper that authenticates; none configured, none shown.
        return bearerToken == nil ? .daemonOnly : .unauthorized
    }

    static func constantTimeEqual(_ a: [UInt8], _ b: [UInt8]) -> Bool {
        var difference = UInt8(a.count == b.count ? 0 : 1)
        for index in 0..<max(a.count, b.count) {
            difference |= (index < a.count ? a[index] : 0) ^ (index < b.count ? b[index] : 0)
        }
        return difference == 0
    }
}

/// `GET /metrics` on an `HTTPListener`: 1 s for a request's first byte and 2 s for the whole
/// of it (8K at most), at most 256 connections (16 per uid on a Unix socket), renders run as
/// tasks, 4 at once, 5 s each. Idle or slow clients cost a slot, never a scraper's answer, and
/// never a token call.
final class MetricsServer: Sendable {
    private let listener: HTTPListener
    var address: ListenAddress { listener.address }

    /// - Parameter group: the Unix socket's group (`MetricsGroup=`, so that its members can
    ///   connect); the daemon's own when nil.
    init(_ address: ListenAddress, group: UInt32? = nil) throws(SocketError) {
        listener = try HTTPListener(address, group: group)
    }

    /// Serves until `stop()`. `render(openMetrics, full)` builds the exposition; `refused(reason)`
    /// counts scrapes not answered in full (forbidden, unauthorized, busy, timeout, full).
    func start(authorization: MetricsAuthorization, render: @escaping @Sendable (Bool, Bool) async -> String,
               refused: @escaping @Sendable (String) -> Void) {
        listener.start(route: { head, peer in
            switch Self.parse(head, peer: peer, authorization) {
            case let .answer(bytes, refusal): return .answer(bytes, refusal: refusal)
            case let .render(openMetrics, full, head):
                return .work {
                    let text = await render(openMetrics, full)
                    let type = openMetrics ? "application/openmetrics-text; version=1.0.0; charset=utf-8" : "text/plain; version=0.0.4; charset=utf-8"
                    return HTTPListener.response(200, head ? "" : text, type: type, length: text.utf8.count)
                }
            }
        }, refused: refused)
    }

    /// Ends the loop (which then closes the listener).
    func stop() {
        listener.stop()
    }

    /// Whether the listener's thread and its scrapes ended within `deadline` of `stop()`.
    func finished(within deadline: Duration) async -> Bool {
        await listener.finished(within: deadline)
    }

    private enum Parsed {
        case answer([UInt8], refusal: String?)
        case render(openMetrics: Bool, full: Bool, head: Bool)
    }

    private static func parse(_ request: [UInt8], peer: PeerCredentials?, _ authorization: MetricsAuthorization) -> Parsed {
        let head = String(decoding: request, as: UTF8.self)
        let lines = head.split(separator: "\r\n", omittingEmptySubsequences: false)
        let words = lines.first?.split(separator: " ") ?? []
        guard words.count == 3, words[2].hasPrefix("HTTP/1.") else { return .answer(HTTPListener.response(400, "bad request\n"), refusal: nil) }
        guard words[0] == "GET" || words[0] == "HEAD" else { return .answer(HTTPListener.response(405, "only GET\n"), refusal: nil) }
        guard words[1] == "/metrics" || words[1].hasPrefix("/metrics?") else { return .answer(HTTPListener.response(404, "try /metrics\n"), refusal: nil) }
        func header(_ name: String) -> String? { HTTPListener.header(name, in: request) }
        let openMetrics = header("accept")?.lowercased().contains("application/openmetrics-text") == true
        switch authorization.view(peer: peer, authorization: header("authorization")) {
        case .full: return .render(openMetrics: openMetrics, full: true, head: words[0] == "HEAD")
        case .daemonOnly: return .render(openMetrics: openMetrics, full: false, head: words[0] == "HEAD")
        case .forbidden: return .answer(HTTPListener.response(403, "forbidden: per-session metrics are for admins and MetricsGroup=\n"), refusal: "forbidden")
        case .unauthorized:
            return .answer(HTTPListener.response(401, "a bearer token is needed\n", extra: "WWW-Authenticate: Bearer realm=\"tokenbroker\"\r\n"), refusal: "unauthorized")
        }
    }
}
