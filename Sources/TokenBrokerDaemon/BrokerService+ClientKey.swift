import BrokerContract
import DPoP
import SQLiteStore
import TokenBrokerCore
import Upstream
import Varlink

extension BrokerService {
    /// `ClientKey`: a `private_key_jwt` session's public client keys, after `change` (see
    /// `ClientKeys`). An operator's key (`ClientKeyFile=`) is shown but not changed; a session
    /// whose assertions come from a file has no key. Changes are logged, with who asked.
    func clientKey(_ session: SessionTable.Session, _ change: ClientKeyChange, by peer: PeerCredentials) throws(BrokerError) -> VarlinkHandling {
        let name = session.configuration.name
        @Sendable func unavailable(_ reason: String) -> BrokerError { .clientKeyUnavailable(session: name, reason: reason) }
        let settings: SessionConfiguration.OAuthSettings
        switch session.kind.ownClient {
        case let .success(own): settings = own
        case let .failure(refusal): throw unavailable(refusal.reason)
        }
        guard settings.client.authentication == .privateKeyJWT else {
            throw unavailable("the session's client does not authenticate with ClientAuthentication=private_key_jwt")
        }
        if settings.client.assertionFile != nil {
            throw unavailable("the session's client assertions come from ClientAssertionFile=: it holds no key")
        }
        if let pem = settings.client.clientKey {
            guard change == .show else { throw unavailable("the key is the operator's (ClientKeyFile=): rotate it by replacing the file and reloading") }
            guard let key = try? SigningKey(pem: Array(pem.reveal.utf8)) else { throw unavailable("ClientKeyFile='s key cannot be read") }
            return .async { sink in
                // (What its assertions are signed with, for this server, as `OperatorClientKey` chooses.)
                let listed = settings.issuer != nil ? try? await session.account?.assertionSigningAlgorithms() : nil
                let algorithm = assertionAlgorithm(for: key, configured: settings.client.assertionAlgorithm, listed: listed ?? nil)
                    ?? settings.client.assertionAlgorithm ?? key.defaultAlgorithm
                sink.send(VarlinkReply(parameters: ["keys": [.object(Self.entry(key, role: "operator", created: 0, algorithm: algorithm).parameters)]]))
            }
        }
        guard let clientKeys else { throw unavailable("this daemon holds no client keys") }
        if change != .show { logger.notice("client key \(change.rawValue) of session \(name) requested by \(peer)", session: name) }
        return .async { [logger] sink in
            // What the server lists decides a new key's algorithm (unless ClientAssertionAlgorithm= does).
            var listed: [String]?
            if settings.issuer != nil {
                do throws(FetchFailure) {
                    listed = try await session.account?.assertionSigningAlgorithms()
                } catch where settings.client.assertionAlgorithm == nil && (change == .show || change == .rotate) {
                    let reason = "the server's metadata cannot be read (\(error.message)): it says which algorithm a new key signs with; "
                        + "try again, or set ClientAssertionAlgorithm="
                    sink.send(unavailable(reason).reply)
                    return
                } catch {
                    // (Only what each key's JWK says of its algorithm depends on it: the stored one.)
                }
            }
            switch await clientKeys.change(change, name,
                                           configured: settings.client.assertionAlgorithm, listed: listed) {
            case let .success(keys):
                // Each key's JWK names the algorithm its assertions are signed with, for this server.
                let entries = keys.map { held in
                    Self.entry(held.key, role: held.stored.role.rawValue, created: held.stored.created,
                               algorithm: clientKeys.algorithm(of: held, configured: settings.client.assertionAlgorithm, listed: listed))
                }
                sink.send(VarlinkReply(parameters: ["keys": .array(entries.map { .object($0.parameters) })]))
            case let .failure(refusal):
                logger.info("client key \(change.rawValue) of session \(name): \(refusal.message)", session: name)
                sink.send(unavailable(refusal.message).reply)
            }
        }
    }

    /// A key as `ClientKey` lists it: its public JWK, naming the algorithm it signs with.
    private static func entry(_ key: SigningKey, role: String, created: Int64, algorithm: SigningKey.Algorithm) -> ClientKeyEntry {
        ClientKeyEntry(kid: key.thumbprint, role: role, algorithm: algorithm.rawValue, created: created,
                       jwk: String(decoding: JSON.object(key.publicJWK(algorithm: algorithm)).encoded, as: UTF8.self))
    }
}
