import Basics
import BrokerContract
import DPoP
import SQLiteStore
import Synchronization
import TokenBrokerCore
import Upstream

/// The client keys the daemon holds for `ClientAuthentication=private_key_jwt` sessions that
/// name neither `ClientKeyFile=` nor `ClientAssertionFile=` (RFC 7523 §2.2): made here the first
/// time a session needs one (P-256, or RSA for a server whose metadata lists only RSA
/// algorithms), kept sealed in the state database like the tokens, never shown but as public
/// JWKs. A session has one signing key, at most one next key (published before it signs:
/// `ctl client-key --rotate`, then `--promote`), and the retiring keys that signed before it
/// (published until `--retire`). Keys belong to the session's name: a logout keeps them.
final class ClientKeys: Sendable {
    /// A key and what the store keeps of it.
    struct Held: Sendable {
        var stored: StoredClientKey
        var key: SigningKey
        var algorithm: SigningKey.Algorithm
    }

    /// The state database (nil in development mode: keys in memory, for the daemon's life).
    private let database: SQLiteSessionStore?
    private let logger: Logger
    /// The keys read or made, by session.
    private let held = Mutex<[String: [Held]]>([:])
    /// Development mode's store.
    private let memory = Mutex<[String: [StoredClientKey]]>([:])
    /// Changes (a key made, a rotation) one at a time, each reading what the last one left.
    private let changes = AsyncSerializer()

    init(database: SQLiteSessionStore?, logger: Logger) {
        self.database = database
        self.logger = logger
    }

    /// Where `session`'s assertions come from, as `settings` say: a platform's file, an
    /// operator's key, or a key held here (`name`'s: a derived session signs with its parent's).
    func source(for name: String, _ settings: SessionConfiguration.OAuthSettings) -> any ClientAssertionSource {
        let audience = settings.client.audience(issuer: settings.issuer)
        if let path = settings.client.assertionFile { return FileClientAssertion(file: AssertionFile(path: path)) }
        if let pem = settings.client.clientKey {
            // (Read at load already: a key that cannot be read now is refused, never replaced.)
            guard let key = try? SigningKey(pem: Array(pem.reveal.utf8)) else { return UnreadableClientKey() }
            return OperatorClientKey(key: key, algorithm: settings.client.assertionAlgorithm, audience: audience)
        }
        return HeldClientKey(keys: self, session: name, configured: settings.client.assertionAlgorithm, audience: audience)
    }

    /// The key that signs `session`'s assertions now, and with which algorithm, made and kept
    /// first when it has none (`listed`: what the server's metadata lists). Every failure is
    /// transient: the client's key says nothing of the session's grant, and the operator's fix
    /// (a rotation, a registration) needs no new login.
    func signingKey(_ session: String, configured: SigningKey.Algorithm?, listed: [String]?) async throws(FetchFailure) -> Held {
        try usable(try await ensureSigningKey(session, configured: configured, listed: listed), configured, listed)
    }

    /// The signing key as it is, made and kept first when there is none.
    private func ensureSigningKey(_ session: String, configured: SigningKey.Algorithm?, listed: [String]?) async throws(FetchFailure) -> Held {
        if let signing = held.withLock({ $0[session]?.first { $0.stored.role == .signing } }) { return signing }
        let result: Result<Held, FetchFailure> = await changes.run {
            do {
                var keys = try await self.load(session)
                if let signing = keys.first(where: { $0.stored.role == .signing }) { return .success(signing) }
                let made = try self.make(.signing, configured: configured, listed: listed)
                keys.append(made)
                try await self.save(session, keys)
                self.logger.notice("made a client key for private_key_jwt (kid \(made.stored.kid), \(made.algorithm.rawValue)): register its "
                                   + "public key with the server (tokenbroker ctl client-key \(session))", session: session)
                return .success(made)
            } catch let failure as FetchFailure {
                return .failure(failure)
            } catch {
                return .failure(.transient("client key: \(error)"))
            }
        }
        return try result.get()
    }

    /// The algorithm `held` signs with for a server that lists `listed`: what `signingKey`
    /// chooses, and what its published JWK says.
    func algorithm(of held: Held, configured: SigningKey.Algorithm?, listed: [String]?) -> SigningKey.Algorithm {
        (try? usable(held, configured, listed))?.algorithm ?? held.algorithm
    }

    /// `held` if it signs with what the server takes, else the failure that says what to do.
    private func usable(_ held: Held, _ configured: SigningKey.Algorithm?, _ listed: [String]?) throws(FetchFailure) -> Held {
        if let configured, !held.key.signs(configured) {
            throw .transient("client configuration: ClientAssertionAlgorithm=\(configured.rawValue), and the session's key is "
                            + "\(held.key.family.rawValue): make a new one with ctl client-key --rotate, register it, then --promote it")
        }
        if let configured, configured != held.algorithm {
            var chosen = held
            chosen.algorithm = configured
            return chosen
        }
        guard let listed, !listed.contains(held.algorithm.rawValue) else { return held }
        if let other = assertionAlgorithm(for: held.key, configured: configured, listed: listed) {
            var chosen = held
            chosen.algorithm = other
            return chosen
        }
        throw .transient("client configuration: the server takes client assertions signed with \(listed.prefix(8).joined(separator: ", ")) only, "
                        + "and the session's key signs \(held.algorithm.rawValue): make a new one with ctl client-key --rotate, register it, "
                        + "then --promote it")
    }

    /// A session's keys as the store has them (read once, then from memory).
    func load(_ session: String) async throws -> [Held] {
        if let keys = held.withLock({ $0[session] }) { return keys }
        let stored = try await database?.clientKeys(session) ?? memory.withLock { $0[session] ?? [] }
        let keys = try stored.map { stored throws(FetchFailure) -> Held in
            guard let der = Base64.decode(stored.key.reveal), let key = try? SigningKey(der: der),
                  let algorithm = SigningKey.Algorithm(rawValue: stored.algorithm), key.signs(algorithm) else {
                throw .transient("client key \(stored.kid) of the state database cannot be read")
            }
            return Held(stored: stored, key: key, algorithm: algorithm)
        }
        // (Another load may have kept them first: theirs stand.)
        return held.withLock { held in
            if let kept = held[session] { return kept }
            held[session] = keys
            return keys
        }
    }

    /// A new key for `role`.
    private func make(_ role: StoredClientKey.Role, configured: SigningKey.Algorithm?, listed: [String]?) throws(FetchFailure) -> Held {
        guard let algorithm = algorithmForNewKey(configured: configured, listed: listed) else {
            throw .transient("client configuration: the server's metadata lists \((listed ?? []).prefix(8).joined(separator: ", ")) for client "
                            + "assertions, none of ES256, RS256, PS256")
        }
        do {
            let key = try SigningKey(for: algorithm)
            let stored = StoredClientKey(kid: key.thumbprint, role: role, algorithm: algorithm.rawValue, key: Secret(Base64.encode(key.privateDER)),
                                         created: UTCTime.unixSeconds())
            return Held(stored: stored, key: key, algorithm: algorithm)
        } catch {
            throw .transient("client key: \(error.description)")
        }
    }

    /// Keeps `keys` as `session`'s, durably, then in memory.
    private func save(_ session: String, _ keys: [Held]) async throws {
        if let database {
            try await database.replaceClientKeys(session, keys.map(\.stored))
        } else {
            memory.withLock { $0[session] = keys.map(\.stored) }
        }
        held.withLock { $0[session] = keys }
    }

    /// Carries out `change` (what `ctl client-key` asks for) on `session`'s keys; returns them
    /// all, or why it cannot.
    func change(_ change: ClientKeyChange, _ session: String, configured: SigningKey.Algorithm?, listed: [String]?) async -> Result<[Held], ClientKeyRefusal> {
        if change == .show || change == .rotate {
            // (A session asked for its keys before its first request gets its signing key now;
            // one whose key the server no longer takes is shown, and rotated, all the same.)
            do { _ = try await ensureSigningKey(session, configured: configured, listed: listed) } catch {
                return .failure(ClientKeyRefusal(error.message))
            }
        }
        return await changes.run { () async -> Result<[Held], ClientKeyRefusal> in
            do {
                var keys = try await self.load(session)
                switch change {
                case .show:
                    return .success(keys)
                case .rotate:
                    if let next = keys.first(where: { $0.stored.role == .next }) {
                        return .failure(ClientKeyRefusal("the session has a next key already (kid \(next.stored.kid)): register it, then "
                                                         + "--promote it (or --retire the retiring ones)"))
                    }
                    keys.append(try self.make(.next, configured: configured, listed: listed))
                case .promote:
                    guard keys.contains(where: { $0.stored.role == .next }) else {
                        return .failure(ClientKeyRefusal("the session has no next key: --rotate makes one"))
                    }
                    for index in keys.indices {
                        switch keys[index].stored.role {
                        case .signing: keys[index].stored.role = .retiring
                        case .next: keys[index].stored.role = .signing
                        case .retiring: break
                        }
                    }
                case .retire:
                    guard keys.contains(where: { $0.stored.role == .retiring }) else {
                        return .failure(ClientKeyRefusal("the session has no retiring key"))
                    }
                    keys.removeAll { $0.stored.role == .retiring }
                }
                try await self.save(session, keys)
                self.logger.notice("client keys: \(change.rawValue): " + keys.map { "\($0.stored.kid) \($0.stored.role.rawValue)" }.joined(separator: ", "),
                                   session: session)
                return .success(keys)
            } catch let failure as FetchFailure {
                return .failure(ClientKeyRefusal(failure.message))
            } catch {
                return .failure(ClientKeyRefusal("the state database: \(error)"))
            }
        }
    }

    /// Forgets what memory holds of `session`'s keys (the store's are the truth: `ctl forget`
    /// removed them there).
    func forget(_ session: String) {
        held.withLock { $0[session] = nil }
        memory.withLock { $0[session] = nil }
    }
}

/// Why `ctl client-key` could not do what it was asked.
struct ClientKeyRefusal: Error, Sendable {
    var message: String
    init(_ message: String) { self.message = message }
}

/// A key the daemon holds signs the session's assertions.
struct HeldClientKey: ClientAssertionSource {
    let keys: ClientKeys
    let session: String
    let configured: SigningKey.Algorithm?
    let audience: AssertionAudience

    func prepare(serverAlgorithms: [String]?) async throws(FetchFailure) -> ClientAssertion {
        let held = try await keys.signingKey(session, configured: configured, listed: serverAlgorithms)
        return .signed(key: held.key, algorithm: held.algorithm, audience: audience)
    }
}

/// `ClientKeyFile=`'s key could not be read when the session was made (it was at load): every
/// request fails, saying so, until a reload reads it again.
struct UnreadableClientKey: ClientAssertionSource {
    func prepare(serverAlgorithms: [String]?) async throws(FetchFailure) -> ClientAssertion {
        throw .transient("client configuration: ClientKeyFile='s key cannot be read; fix it and reload")
    }
}

/// A platform's file holds the session's assertion (`ClientAssertionFile=`).
struct FileClientAssertion: ClientAssertionSource {
    let file: AssertionFile

    func prepare(serverAlgorithms: [String]?) async throws(FetchFailure) -> ClientAssertion { .file(file) }
}
