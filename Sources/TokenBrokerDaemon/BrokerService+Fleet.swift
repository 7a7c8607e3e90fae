import BrokerContract
import Fleet
import Varlink

extension BrokerService {
    /// ResetFleetHistory: starts a fleet session's history anew — the admin's way out of a fleet
    /// generation at its limit. Under the boundary gate, as a logout (never on a coordinator a
    /// reload is handing over): etcd gets a signed-out state in a new history, this host logs
    /// out with it (its refresh token revoked as at a logout), and every other broker follows.
    /// Logged, with who asked.
    func resetFleetHistory(_ name: String, by peer: PeerCredentials) -> VarlinkHandling {
        .async { [self] sink in
            do {
                sink.send(try await boundary(name) { [self] session in
                    guard let fleet = session.fleetSync else { return ParameterError(name: "session").reply }
                    let position = try await fleet.startHistoryAnew(handingOver: revocation(for: session))
                    session.replies.clear()
                    logger.log(.warning, "the fleet history of session \(name) was started anew by \(peer) (fleet \(position)); "
                               + "every broker follows it as a logout: log in to go on", session: name)
                    return VarlinkReply(parameters: FleetResetReply(history: position.history, generation: position.generation).parameters)
                })
            } catch is CancellationError {
                // The client is gone; nobody to answer (what reached etcd has run to its end).
            } catch {
                sink.send(reply(for: error, session: name))
            }
        }
    }
}
