import Basics
import BrokerContract
import Synchronization
import TokenBrokerCore
import Upstream

/// The interactive logins under way (device and code): at most one per session, `mostAtOnce`
/// in all; a code login, once it waits for its redirect, can be found (`waiting`).
final class InteractiveLogins: Sendable {
    static let mostAtOnce = 16

    private enum Slot {
        /// Claimed: a device login, or a code login still finding its endpoints and its port.
        case claimed
        case waiting(CodeLogin)
    }

    private let slots = Mutex<[String: Slot]>([:])

    enum Claim: Equatable { case claimed, busy, full }

    /// Claims the session's slot for a new login.
    func claim(_ session: String) -> Claim {
        slots.withLock { slots in
            if slots[session] != nil { return .busy }
            if slots.count >= Self.mostAtOnce { return .full }
            slots[session] = .claimed
            return .claimed
        }
    }

    /// The login is ready for its redirect: `waiting(session)` finds it.
    func publish(_ login: CodeLogin) {
        slots.withLock { $0[login.session] = .waiting(login) }
    }

    /// Frees the session's slot (the login ended, or never started).
    func release(_ session: String) {
        _ = slots.withLock { $0.removeValue(forKey: session) }
    }

    /// The session's login that waits for its redirect, if any.
    func waiting(_ session: String) -> CodeLogin? {
        slots.withLock { slots in
            if case let .waiting(login)? = slots[session] { return login }
            return nil
        }
    }
}

/// One authorization code login, between its prompt and its end: the request the redirect must
/// answer, the first answer that does (from the listener or pasted), and the login's result,
/// for everyone who brought an answer to wait for.
final class CodeLogin: Sendable {
    let session: String
    let request: AuthorizationRequest

    /// What an offered redirect did.
    enum Offer: Equatable {
        /// It is the login's answer: wait for `result()`.
        case taken
        /// Not this login's answer (why, never the input's values): nothing changed.
        /// `answersLogin`: it carried the login's state (`RedirectOutcome.invalid`).
        case invalid(String, answersLogin: Bool)
        /// The login has its answer already, or has ended.
        case closed
    }

    /// The answer the login waits for: a code to redeem, or the server's refusal.
    enum Answer: Sendable, Equatable {
        case code(Secret)
        case denied(error: String, description: String?)
    }

    /// The first answer, until the login stops taking one (`answer(within:)` returns).
    private let answered = OneShot<Answer>()
    /// The login's result, for everyone who brought an answer.
    private let ended = OneShot<Result<Int, BrokerError>>()
    /// The requests the listener refused, in words (`refuse`), until the login ends.
    let refusals: AsyncStream<String>
    private let refused: AsyncStream<String>.Continuation
    /// Refusals told so far: of redirects that carried the login's state, and of the rest.
    private let refusalsTold = Mutex((answers: 0, others: 0))
    /// Refusals told at most, per login, of each kind; the last one says that more are not.
    /// Apart, so that requests anyone can send cannot spend the budget of the one a browser
    /// brings back from this login's own authorization request.
    static let mostRefusalsTold = (answers: 20, others: 10)

    init(session: String, request: AuthorizationRequest) {
        self.session = session
        self.request = request
        (refusals, refused) = AsyncStream.makeStream(of: String.self,
                                                     bufferingPolicy: .bufferingOldest(Self.mostRefusalsTold.answers + Self.mostRefusalsTold.others + 2))
    }

    /// The listener refused a request that came for the login (never the request's values in
    /// `reason` but a sanitized Host): said to the journal and the caller, up to
    /// `mostRefusalsTold` per login of each kind (`answersLogin`: the request carried the
    /// login's state).
    func refuse(_ reason: String, answersLogin: Bool = false) {
        let (told, most) = refusalsTold.withLock { count in
            defer { if answersLogin { count.answers += 1 } else { count.others += 1 } }
            return answersLogin ? (count.answers, Self.mostRefusalsTold.answers) : (count.others, Self.mostRefusalsTold.others)
        }
        if told < most {
            refused.yield(reason)
        } else if told == most {
            refused.yield(answersLogin ? "more redirects for this login were refused; they are not told one by one"
                                       : "more requests were refused; they are not told one by one")
        }
    }

    /// Offers a redirect (a request-target from the listener, or a pasted URL); the first that
    /// answers the login is taken, whatever came before it that did not.
    func offer(_ redirect: String) -> Offer {
        let answer: Answer
        switch AuthorizationRequest.readRedirect(redirect, expecting: request) {
        case let .invalid(reason, answersLogin): return .invalid(reason, answersLogin: answersLogin)
        case let .code(code): answer = .code(code)
        case let .denied(error, description): answer = .denied(error: error, description: description)
        }
        return answered.set(answer) ? .taken : .closed
    }

    /// The login's answer, or nil when none came within `timeout` or the task was cancelled.
    /// After it returns, nothing more is taken.
    func answer(within timeout: Duration) async -> Answer? {
        let got = await answered.wait(upTo: timeout)
        // Closed at once: an answer taken meanwhile is the one returned.
        return answered.close() ?? got
    }

    /// Ends the login: everyone waiting for `result()` hears it.
    func finish(_ result: Result<Int, BrokerError>) {
        refused.finish()
        answered.close()
        ended.set(result)
    }

    /// The login's result, once it has one (the login's own task always gives it one); nil
    /// when the waiting task is cancelled (its caller went away).
    func result() async -> Result<Int, BrokerError>? {
        await ended.wait()
    }
}

/// The loopback listener of one code login (RFC 8252 §7.3): it answers `GET /callback` only,
/// hands the redirect to the login, and shows the browser the login's result. Everything
/// else is a 404 or a 405; a redirect that is not the login's answer a 400, and the login
/// goes on waiting. Only a browser's navigation to the redirect URI itself is heard: a `Host`
/// other than the URI's (a DNS-rebinding page) is refused, and so is a request that says it
/// is not a navigation (`Sec-Fetch-Mode`: a page's script or image fetching it). Pages for
/// refused requests name no session.
enum RedirectListener {
    static let path = "/callback"

    /// Binds `127.0.0.1` on the first free port of `ports` (none: one the kernel picks). The
    /// browser's page waits for the redemption, which takes up to two token requests
    /// (`requestTimeout` each: a DPoP nonce costs one more).
    static func open(ports: [UInt16], requestTimeout: Duration) -> HTTPListener? {
        let limits = HTTPListenerLimits(maximumConnections: 16, maximumPerUser: 16, concurrentWork: 4, firstByteDeadline: .seconds(5),
                                        requestDeadline: .seconds(10), answerDeadline: .seconds(5),
                                        workDeadline: requestTimeout * 2 + .seconds(10))
        for port in ports.isEmpty ? [0] : ports {
            if let listener = try? HTTPListener(.tcp(host: "127.0.0.1", port: port), limits: limits) { return listener }
        }
        return nil
    }

    /// Refusals of requests that came for the login (another Host, not a navigation, not a GET,
    /// not its answer) are told to it (`CodeLogin.refuse`); requests for other paths (a
    /// browser's `/favicon.ico`) and what is not HTTP are not.
    static func route(_ head: [UInt8], _ login: CodeLogin, host: String) -> HTTPRouting {
        guard let (method, target) = HTTPListener.requestLine(head) else { return .answer(page(400, "Bad request", "This is not an HTTP request."), refusal: nil) }
        let forLogin = target.prefix(while: { $0 != "?" }) == path
        guard let asked = HTTPListener.header("host", in: head), asked == host else {
            if forLogin { login.refuse("a request for Host \(shown(HTTPListener.header("host", in: head))), not \(host) (the redirect URI's host and port, exactly)") }
            return .answer(page(400, "Wrong host", "This listener answers requests for \(host) only."), refusal: nil)
        }
        if let mode = HTTPListener.header("sec-fetch-mode", in: head), mode != "navigate" {
            if forLogin { login.refuse("a request that was not a browser's navigation (Sec-Fetch-Mode: \(shown(mode)))") }
            return .answer(page(403, "Forbidden", "Only a browser's navigation to the redirect is heard here."), refusal: nil)
        }
        guard forLogin else {
            return .answer(page(404, "Not found", "This listener takes one thing: the login's redirect."), refusal: nil)
        }
        guard method == "GET" else {
            login.refuse("a \(shown(method)) request (the redirect is a GET)")
            return .answer(page(405, "Method not allowed", "The login's redirect is a GET."), refusal: nil)
        }
        switch login.offer(String(target)) {
        case let .invalid(reason, answersLogin):
            login.refuse("a redirect that is not this login's answer: \(reason)", answersLogin: answersLogin)
            return .answer(page(400, "Not this login's answer", "\(reason). The login is still waiting."), refusal: nil)
        case .closed:
            return .answer(page(409, "Login over", "The login has its answer already, or has ended."), refusal: nil)
        case .taken:
            return .work {
                switch await login.result() {
                case let .success(generation)?:
                    return page(200, "Logged in", "tokenbroker: \(login.session) is logged in (generation \(generation)). You can close this window.")
                case let .failure(.loginFailed(_, reason))?:
                    return page(403, "Login failed", "tokenbroker: the login of \(login.session) failed: \(reason)")
                case let .failure(error)?:
                    return page(403, "Login failed", "tokenbroker: the login of \(login.session) failed (\(error.name)).")
                case nil:
                    // (The listener stopped before the login ended: the daemon is stopping.)
                    return page(503, "Login not finished", "tokenbroker stopped before the login of \(login.session) ended; log in again.")
                }
            }
        }
    }

    /// A request's value as a refusal shows it: visible ASCII, at most 64 bytes, else a note.
    static func shown(_ value: (some StringProtocol)?) -> String {
        guard let value else { return "(none)" }
        guard value.utf8.count <= 64, value.utf8.allSatisfy({ $0 > 0x20 && $0 < 0x7F }) else { return "(unprintable or long)" }
        return String(value)
    }

    /// A small HTML page that loads nothing, is not cached, and sends no referrer.
    static func page(_ status: Int, _ title: String, _ text: String) -> [UInt8] {
        let body = "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>\(escape(title))</title></head>"
            + "<body><h1>\(escape(title))</h1><p>\(escape(text))</p></body></html>\n"
        return HTTPListener.response(status, body, type: "text/html; charset=utf-8",
                                     extra: "Cache-Control: no-store\r\nContent-Security-Policy: default-src 'none'\r\n"
                                        + "Referrer-Policy: no-referrer\r\nX-Content-Type-Options: nosniff\r\n")
    }

    static func escape(_ text: String) -> String {
        var escaped = ""
        escaped.reserveCapacity(text.utf8.count)
        for character in text {
            switch character {
            case "&": escaped += "&amp;"
            case "<": escaped += "&lt;"
            case ">": escaped += "&gt;"
            case "\"": escaped += "&quot;"
            case "'": escaped += "&#39;"
            default: escaped.append(character)
            }
        }
        return escaped
    }
}
