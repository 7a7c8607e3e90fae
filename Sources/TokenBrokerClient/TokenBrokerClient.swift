#if canImport(Glibc)
import Glibc
#endif
import Basics
import BrokerContract
import Synchronization
import TokenBrokerCore
import Varlink

/// A current access token as the broker hands it out.
public struct AccessToken: Sendable, Equatable, CustomStringConvertible {
    /// The bearer credential. Never log it.
    public var token: String
    public var tokenType: String
    /// Expiry, Unix seconds.
    public var expiresAt: Int64?
    public var generation: Int

    public var description: String { "access token (generation \(generation))" }
}

/// An access token with the DPoP proof (RFC 9449) for one request, as `proof(session:…)`
/// answers: send `headers`. The proof is signed in the broker; the key never leaves it.
public struct ProvenToken: Sendable, Equatable, CustomStringConvertible {
    public var token: AccessToken
    /// The `DPoP` header's value, good for the one request it was made for; nil for a bearer
    /// session (then `headers` is `Authorization: Bearer …` alone). Never log it.
    public var proof: String?

    /// `Authorization: <type> <token>`, and `DPoP: <proof>` when there is one.
    public var headers: [(name: String, value: String)] {
        var headers = [(name: "Authorization", value: "\(token.tokenType) \(token.token)")]
        if let proof { headers.append((name: "DPoP", value: proof)) }
        return headers
    }

    public var description: String { "\(token)\(proof == nil ? "" : " with a DPoP proof")" }
}

/// What a subscriber of `watch(session:)` receives.
public enum TokenEvent: Sendable, Equatable {
    case token(AccessToken, serial: Int)
    case signedOut(generation: Int)
}

/// The broker's errors, mirroring the contract's, plus the client's own.
public enum TokenBrokerError: Error, Sendable, Equatable, CustomStringConvertible {
    case noSuchSession(String)
    case signedOut(String)
    case permissionDenied
    case refreshFailed(session: String, reason: String, retryable: Bool, retryAfter: Double?)
    case throttled(session: String, retryAfter: Double)
    /// A token valid for `minValid` seconds was asked for; the issuer's tokens live `lifetime`.
    case lifetimeTooShort(session: String, lifetime: Double, minValid: Double)
    /// The broker could not be reached (not running, wrong socket, no permission on it).
    case unavailable(String)
    /// The broker answered something unexpected (another error name, a malformed reply).
    case unexpected(String)

    public var description: String {
        switch self {
        case let .noSuchSession(session): return "no session named '\(session)'"
        case let .signedOut(session): return "session '\(session)' is signed out"
        case .permissionDenied: return "permission denied"
        case let .refreshFailed(session, reason, retryable, _): return "refresh of '\(session)' failed: \(reason)\(retryable ? "" : " (session ended)")"
        case let .throttled(session, retryAfter): return "refresh limit reached for '\(session)'; retry in \(retryAfter)s"
        case let .lifetimeTooShort(session, lifetime, minValid):
            return "the tokens of '\(session)' live \(lifetime)s, less than the \(minValid)s asked"
        case let .unavailable(reason): return "broker unavailable: \(reason)"
        case let .unexpected(reason): return "unexpected answer from the broker: \(reason)"
        }
    }
}

/// A client of the tokenbroker daemon for Swift workers.
///
/// One connection, reused for every call and re-established when it breaks (the broker
/// restarted): a call that fails on a broken connection is sent once more on a new one, which
/// is safe for `GetToken` and `Recover`. Calls from several tasks are sent one after another
/// on that connection (varlink answers in order); use several clients for parallel requests.
/// The blocking socket work runs on the client's own thread, never in the cooperative pool.
public final class TokenBrokerClient: Sendable {
    public static let defaultSocket = BrokerContract.defaultSocket

    public let address: VarlinkAddress
    private let timeout: Double
    private let thread = SerialThread()
    private let connection = ConnectionBox()

    /// The connection, touched only on `thread`.
    private final class ConnectionBox: @unchecked Sendable {
        // @unchecked: `client` is read and written only by jobs on the client's serial thread.
        var client: VarlinkClient?
    }

    /// - Parameters:
    ///   - socketPath: the broker's socket; default `$TOKENBROKER_SOCKET`, else the system one.
    ///   - timeout: the longest wait for one answer (a refresh may take a while upstream).
    public init(socketPath: String? = nil, timeout: Duration = .seconds(60)) {
        let path = socketPath ?? BrokerContract.socket()
        address = VarlinkAddress(path: path)
        self.timeout = Double(timeout.components.seconds) + Double(timeout.components.attoseconds) / 1e18
    }

    /// The session's current token (refreshed first by the broker if it has expired). With
    /// `minValid`, one that stays valid at least that long (a job's length): a token that ends
    /// sooner is refreshed first, in the session's one refresh; `lifetimeTooShort` when the
    /// issuer's tokens live less (whole seconds, rounded up). With `resource` and/or `scope`,
    /// the session's token narrowed to that key (RFC 8707, a scope within the session's), one
    /// the session allows (`AllowResources=`, `AllowScopes=`): its own token and refresh.
    public func token(session: String, minValid: Duration? = nil, resource: String? = nil,
                      scope: String? = nil) async throws(TokenBrokerError) -> AccessToken {
        AccessToken(TokenReply(try await call(.getToken(session: session, minValid: minValid.map(Self.wholeSeconds),
                                                        key: TokenKey(resource: resource, scope: scope))).parameters))
    }

    /// The token to retry with after `rejected` was refused (`401 invalid_token`): the current
    /// one if it is another, else a new one from the session's single refresh (of the key
    /// `rejected` was asked for with, if any).
    public func recover(session: String, rejected: String, resource: String? = nil,
                        scope: String? = nil) async throws(TokenBrokerError) -> AccessToken {
        AccessToken(TokenReply(try await call(.recover(session: session, rejected: rejected,
                                                       key: TokenKey(resource: resource, scope: scope))).parameters))
    }

    /// The session's current token with a DPoP proof for one request of `method` to `url`
    /// (`GetProof`); `nonce` is the resource server's (`DPoP-Nonce`), `rejected` a token the
    /// server refused (then the token to retry with, as `recover` answers); `resource` and
    /// `scope` a key, as `token` takes.
    public func proof(session: String, method: String, url: String, nonce: String? = nil, rejected: String? = nil,
                      minValid: Duration? = nil, resource: String? = nil, scope: String? = nil) async throws(TokenBrokerError) -> ProvenToken {
        let request = BrokerRequest.getProof(session: session, method: method, uri: url, nonce: nonce, rejected: rejected,
                                             minValid: minValid.map(Self.wholeSeconds), key: TokenKey(resource: resource, scope: scope))
        let reply = ProofReply(try await call(request).parameters)
        return ProvenToken(token: AccessToken(reply.token), proof: reply.proof)
    }

    /// A duration as the contract's whole seconds: rounded up, 1 to a year.
    static func wholeSeconds(_ duration: Duration) -> Int64 {
        let (seconds, atto) = duration.components
        guard seconds < BrokerRequest.longestMinValid else { return BrokerRequest.longestMinValid }
        return max(seconds + (atto > 0 ? 1 : 0), 1)
    }

    /// The session's events: the current token at once, every new token, and the logout
    /// (after which the sequence ends). Runs on its own connection; ending the iteration (or
    /// cancelling the task) closes it.
    public func watch(session: String) -> AsyncThrowingStream<TokenEvent, any Error> {
        let (stream, continuation) = AsyncThrowingStream.makeStream(of: TokenEvent.self)
        let address = self.address
        // The reading thread's descriptor while its connection is open (-1 otherwise), and
        // whether the consumer has gone; both under one lock, so that ending the stream can
        // unblock the thread's read but never touch a descriptor already closed and reused.
        let link = WatchLink()
        continuation.onTermination = { _ in
            link.state.withLock { state in
                state.finished = true
                if state.descriptor >= 0 { shutdown(state.descriptor, Int32(SHUT_RDWR)) }
            }
        }
        spawnThread {
            let client: VarlinkClient
            do throws(VarlinkClientError) {
                client = try VarlinkClient(address: address, timeout: 0)
            } catch {
                continuation.finish(throwing: TokenBrokerError.unavailable(error.description))
                return
            }
            let alreadyFinished = link.state.withLock { state in
                state.descriptor = client.fileDescriptor
                return state.finished
            }
            // Forget the descriptor before the client (and its descriptor) goes away; the
            // client is kept alive until then.
            defer {
                link.state.withLock { $0.descriptor = -1 }
                withExtendedLifetime(client) {}
            }
            if alreadyFinished { return }
            var first = true
            while true {
                let reply: VarlinkReply
                do throws(VarlinkClientError) {
                    reply = first ? try client.call(BrokerRequest.watch(session: session).call) : try client.nextReply()
                } catch {
                    let gone = link.state.withLock { $0.finished }
                    continuation.finish(throwing: gone ? nil : TokenBrokerError.unavailable(error.description))
                    return
                }
                first = false
                if let error = Self.error(reply, session: session) {
                    continuation.finish(throwing: error)
                    return
                }
                switch WatchEvent(reply.parameters) {
                case let .signedOut(generation): continuation.yield(.signedOut(generation: generation))
                case let .token(token, serial): continuation.yield(.token(AccessToken(token), serial: serial))
                }
                guard reply.continues else {
                    continuation.finish()
                    return
                }
            }
        }
        return stream
    }

    private final class WatchLink: Sendable {
        struct State {
            var descriptor: Int32 = -1
            var finished = false
        }
        let state = Mutex(State())
    }

    // MARK: - Calls

    private func call(_ request: BrokerRequest) async throws(TokenBrokerError) -> VarlinkReply {
        let (address, timeout, connection) = (self.address, self.timeout, self.connection)
        let outcome: Result<VarlinkReply, VarlinkClientError>
        do {
            outcome = try await thread.run {
                // Two tries: the first on the kept connection, the second on a new one if the
                // first found it broken.
                var lastError = VarlinkClientError.closed
                for attempt in 0..<2 {
                    do throws(VarlinkClientError) {
                        if connection.client == nil { connection.client = try VarlinkClient(address: address, timeout: timeout) }
                        return .success(try connection.client!.call(request.call))
                    } catch {
                        connection.client = nil
                        lastError = error
                        if case .unreachable = error { break }
                        if attempt == 1 { break }
                    }
                }
                return .failure(lastError)
            }
        } catch {
            throw .unavailable("\(error)")
        }
        let reply: VarlinkReply
        switch outcome {
        case let .success(value): reply = value
        case let .failure(error): throw .unavailable(error.description)
        }
        if let error = Self.error(reply, session: request.session ?? "") { throw error }
        return reply
    }

    /// The contract's errors as the library's typed errors.
    static func error(_ reply: VarlinkReply, session: String) -> TokenBrokerError? {
        guard let name = reply.error else { return nil }
        switch BrokerError(reply, session: session) {
        case let .noSuchSession(session)?: return .noSuchSession(session)
        case let .signedOut(session, _)?: return .signedOut(session)
        case .permissionDenied?: return .permissionDenied
        case let .refreshFailed(session, reason, retryable, retryAfter)?:
            return .refreshFailed(session: session, reason: reason, retryable: retryable, retryAfter: retryAfter)
        case let .throttled(session, retryAfter)?: return .throttled(session: session, retryAfter: retryAfter)
        case let .lifetimeTooShort(session, lifetime, minValid)?: return .lifetimeTooShort(session: session, lifetime: lifetime, minValid: minValid)
        default: return .unexpected(name)
        }
    }
}

extension AccessToken {
    init(_ reply: TokenReply) {
        self.init(token: reply.token, tokenType: reply.tokenType, expiresAt: reply.expiresAt, generation: reply.generation)
    }
}
