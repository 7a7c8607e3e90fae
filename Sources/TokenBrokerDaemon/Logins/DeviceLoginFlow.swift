import Basics
import BrokerContract
import TokenBrokerCore
import Upstream

/// The device authorization grant (RFC 8628) as a login of a session.
extension BrokerService {
    /// DeviceLogin: start the device grant, tell the caller where to approve it, poll, and log
    /// the session in with what it yields. The caller disconnecting stops the polling, but a
    /// poll under way runs to its answer: it may carry the tokens of a login the user
    /// approved, which the server gives only once (so the polling runs in the upstream pool,
    /// which the daemon drains at its stop).
    func runDeviceLogin(_ session: SessionTable.Session, _ upstream: any UpstreamAccount, prompt: (DeviceLoginEvent) -> Void) async -> LoginOutcome {
        let name = session.configuration.name
        func failed(_ reason: String) -> LoginOutcome { .failed(loginFailure(name, "device login", reason)) }
        let began = await session.coordinator.status().generation
        let client: OAuthClient
        let proofKey: Secret?
        do {
            (client, proofKey) = try await loginClient(upstream)
        } catch {
            return failed(error.message)
        }
        let authorization: DeviceAuthorization
        do {
            authorization = try await client.startDeviceAuthorization()
        } catch {
            return failed(error.description)
        }
        let event = DeviceLoginEvent.prompt(verificationUri: authorization.verificationURI, userCode: authorization.userCode,
                                             expiresIn: Int64(authorization.expiresIn.seconds),
                                             verificationUriComplete: authorization.verificationURIComplete)
        prompt(event)
        let abandoned = SynchronizedBox(false)
        let polled: Result<FetchedToken, DeviceLoginError> = await withTaskCancellationHandler {
            await outliving.outliving({ () -> Result<FetchedToken, DeviceLoginError> in
                do throws(DeviceLoginError) {
                    return .success(try await client.completeDeviceLogin(authorization, clock: ContinuousClock(), stop: { abandoned.value }))
                } catch {
                    return .failure(error)
                }
            }, refused: .failure(.failed(.transient("the daemon is stopping"))))
        } onCancel: {
            abandoned.value = true
        }
        let token: FetchedToken
        switch polled {
        case let .success(fetched): token = fetched
        case let .failure(error):
            if abandoned.value { return .abandoned }
            return failed(error.description)
        }
        return LoginOutcome(await install(name, "device login", upstream, client, token, proofKey: proofKey, began: began))
    }
}
