import Basics
import BrokerContract
import TokenBrokerCore
import Upstream
import Varlink

/// The interactive logins' methods: the device grant (`DeviceLogin`), the authorization code
/// grant with PKCE (`CodeLogin`, `CompleteCodeLogin`), and which of them suits a session
/// (`LoginFlow`). The flows (`DeviceLoginFlow`, `CodeLoginFlow`) say what to prompt and how
/// the login ended (`LoginOutcome`); this maps them to the calls' replies.
extension BrokerService {
    func deviceLogin(_ session: SessionTable.Session, by peer: PeerCredentials) throws(BrokerError) -> VarlinkHandling {
        let name = session.configuration.name
        let upstream = try loginUpstream(session)
        try claimLogin(name)
        logger.notice("device login of session \(name) started by \(peer)", session: name)
        return .async { [self] sink in
            let outcome = await runDeviceLogin(session, upstream) { sink.send(VarlinkReply(parameters: $0.parameters, continues: true)) }
            if let reply = outcome.reply(done: { DeviceLoginEvent.done($0).parameters }) { sink.send(reply) }
            interactiveLogins.release(name)
        }
    }

    func codeLogin(_ session: SessionTable.Session, by peer: PeerCredentials, tellingRefusals: Bool = false) throws(BrokerError) -> VarlinkHandling {
        let name = session.configuration.name
        let upstream = try loginUpstream(session)
        let settings = try loginSettings(session)
        try claimLogin(name)
        logger.notice("code login of session \(name) started by \(peer)", session: name)
        return .async { [self] sink in
            let outcome = await runCodeLogin(session, upstream, settings, prompt: { sink.send(VarlinkReply(parameters: $0.parameters, continues: true)) },
                                             refused: { reason in
                if tellingRefusals { sink.send(VarlinkReply(parameters: CodeLoginEvent.refused(reason: reason).parameters, continues: true)) }
            })
            if let reply = outcome.reply(done: { CodeLoginEvent.done($0).parameters }) { sink.send(reply) }
            interactiveLogins.release(name)
        }
    }

    /// CompleteCodeLogin: the pasted redirect, offered to the session's waiting login.
    func completeCodeLogin(_ name: String, redirect: String, by peer: PeerCredentials) -> VarlinkHandling {
        .async { [self] sink in
            guard let login = interactiveLogins.waiting(name) else {
                sink.send(BrokerError.loginFailed(session: name, reason: "no code login of this session is waiting for its redirect "
                                                  + "(start one with `tokenbroker ctl login \(name) --flow=code`; it may have ended)").reply)
                return
            }
            switch login.offer(redirect) {
            case let .invalid(reason, _):
                logger.notice("a redirect pasted by \(peer) for the code login of session \(name) was refused: \(reason)", session: name)
                sink.send(BrokerError.loginFailed(session: name, reason: reason + CodeLoginEvent.stillWaiting).reply)
            case .closed:
                sink.send(BrokerError.loginFailed(session: name, reason: "the login has its answer already, or has ended").reply)
            case .taken:
                logger.notice("the code login of session \(name) was answered by a redirect pasted by \(peer)", session: name)
                switch await login.result() {
                case let .success(generation)?: sink.send(VarlinkReply(parameters: LoginReply(generation: generation).parameters))
                case let .failure(error)?: sink.send(error.reply)
                case nil: return   // (the caller went away)
                }
            }
        }
    }

    /// LoginFlow: `LoginFlow=`, else the device flow when the server has a device
    /// authorization endpoint (configured or discovered), else the code flow.
    func loginFlow(_ session: SessionTable.Session) throws(BrokerError) -> VarlinkHandling {
        let name = session.configuration.name
        let upstream = try loginUpstream(session)
        let settings = try loginSettings(session)
        switch settings.login.flow {
        case .device: return .reply(VarlinkReply(parameters: LoginFlowReply(flow: .device, reason: "LoginFlow=device").parameters))
        case .code: return .reply(VarlinkReply(parameters: LoginFlowReply(flow: .code, reason: "LoginFlow=code").parameters))
        case .auto:
            let source = settings.issuer == nil ? "configured" : "configured or in its metadata"
            return .async { sink in
                do throws(FetchFailure) {
                    let endpoints = try await upstream.endpoints()
                    let chosen = endpoints.deviceAuthorization != nil
                        ? LoginFlowReply(flow: .device, reason: "LoginFlow=auto, and the server has a device authorization endpoint (\(source))")
                        : LoginFlowReply(flow: .code, reason: "LoginFlow=auto, and the server has no device authorization endpoint (\(source))")
                    sink.send(VarlinkReply(parameters: chosen.parameters))
                } catch {
                    sink.send(BrokerError.loginFailed(session: name, reason: error.message).reply)
                }
            }
        }
    }
}
