import BrokerContract
import Varlink

/// How an interactive login ended, as the flows report it (`DeviceLoginFlow`, `CodeLoginFlow`);
/// the service maps it to the call's last reply.
enum LoginOutcome: Sendable, Equatable {
    /// Installed: the session's new generation.
    case loggedIn(generation: Int)
    case failed(BrokerError)
    /// Its caller went away (or the daemon is stopping): nobody to answer.
    case abandoned

    init(_ result: Result<Int, BrokerError>) {
        switch result {
        case let .success(generation): self = .loggedIn(generation: generation)
        case let .failure(error): self = .failed(error)
        }
    }

    /// The last reply of the login's call (`done` is the flow's own wording of success); nil
    /// when abandoned.
    func reply(done: (LoginReply) -> JSONObject) -> VarlinkReply? {
        switch self {
        case let .loggedIn(generation): return VarlinkReply(parameters: done(LoginReply(generation: generation)))
        case let .failed(error): return error.reply
        case .abandoned: return nil
        }
    }
}
