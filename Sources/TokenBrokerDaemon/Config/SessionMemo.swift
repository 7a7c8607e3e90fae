import Synchronization

/// The sessions the last configuration load read, each with the lines it was read from: a load
/// takes a session whose lines are the same as the last load's (the same name, first line, and
/// every assignment's key, value, file and line) as it was, without reading its values again.
///
/// Only where the lines are all there is: a session read with no error and no warning, whose
/// every key is in `pureKeys` (its value alone decides what it sets: no file, credential, user
/// or group database is read). Whatever else a session names is read again at every load. A
/// reload of thousands of sessions changing a few had read every session's values again (a
/// third of its instructions); a session taken from here is also the running one's box, so the
/// reload's comparison of the two is one pointer's.
///
/// Each load replaces what is kept with its own sessions (those of the last load only, so the
/// memory is bounded by one configuration's).
final class SessionMemo: Sendable {
    struct Read: Sendable {
        let file: String
        let line: Int
        let entries: [INIEntry]
        let session: SessionConfiguration
    }

    typealias Reads = [String: Read]

    static let shared = SessionMemo()

    private let reads = Mutex<Reads>([:])

    /// What the last load kept (and nothing is kept meanwhile: two loads at once each read in
    /// full what the other took).
    func take() -> Reads {
        reads.withLock { kept in
            defer { kept = [:] }
            return kept
        }
    }

    func keep(_ read: Reads) {
        reads.withLock { $0 = read }
    }

    /// The `[Session]` keys whose value alone decides what they set: a key is added here only
    /// if its parser reads nothing but the value (no file, credential, environment, user or
    /// group database, clock or name lookup); `ConfigTests.pureKeys` checks none of these is
    /// one of those that do.
    static let pureKeys: Set<String> = [
        "Name", "Fleet", "Upstream", "TestTokenLifetime", "Grant", "Issuer", "TokenEndpoint", "RevocationEndpoint",
        "DeviceAuthorizationEndpoint", "AuthorizationEndpoint", "LoginFlow", "LoginRedirectPorts", "LoginTimeout", "ClientID",
        "ClientAuthentication", "ClientAssertionAudience", "ClientAssertionAlgorithm", "Scope", "ConnectTimeout", "RequestTimeout",
        "RevokeOnLogout", "DPoP", "Serves", "DerivedFrom", "Derivation", "Audience", "Resource", "AllowResources", "AllowScopes",
        "KeyDerivation", "MaxKeys", "RefreshAhead", "RefreshLimitBurst", "RefreshLimitInterval", "BackoffInitial", "BackoffMax",
    ]

    static func linesOnly(_ entries: [INIEntry]) -> Bool {
        entries.allSatisfy { pureKeys.contains($0.key) }
    }
}
