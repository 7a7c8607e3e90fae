/// A `[Delegation]`: chosen sessions exposed on a socket of their own, for a container or a
/// host that reaches the broker through that socket alone. The delegation is the principal:
/// on its socket only the token methods of its sessions answer (GetToken, Recover, GetProof,
/// Watch, Credential, Status), for every peer alike — root on the far side is nobody special.
/// `AllowUsers=`/`AllowGroups=` narrow further, by the peer's ids as the kernel reports them.
public struct DelegationConfiguration: Sendable, Equatable {
    public var name: String
    /// The sessions it exposes (configured sessions, derived ones included), in order.
    public var sessions: [String] = []
    /// Where its socket is bound (an absolute path; empty: it has none, only a file).
    public var socket: String = ""
    /// The token file it keeps (`ctl delegate --file`; a `[Delegation]` has none: files are
    /// configured as `[Output]` sections).
    public var file: TokenFileConfiguration?
    /// Owner, group and mode of the socket file (the daemon's user and group when nil).
    public var socketUser: UInt32?
    public var socketGroup: UInt32?
    public var socketMode: UInt32 = 0o660
    /// When both are empty, whoever can open the socket; else only these peers.
    public var allowUsers: [UInt32] = []
    public var allowGroups: [UInt32] = []
    /// Connections open on its socket at once.
    public var maxConnections = 64
    /// When it ends by itself (Unix seconds); nil: when it is removed.
    public var expiresAt: Int64?

    public init(name: String) { self.name = name }

    /// Whether `text` can name a delegation: as a session's name.
    public static func isName(_ text: String) -> Bool { ConfigValue.isSessionName(text) }

    /// What is wrong with `path` as a delegation's socket, if anything: an absolute path that
    /// fits a socket address (107 bytes), visible ASCII, no `.` or `..` component.
    public static func socketProblem(_ path: String) -> String? {
        fileProblem(path, limit: 107, "longer than a socket address may be (107 bytes)")
    }

    /// What is wrong with `path` as the path of a file the daemon makes: absolute, at most
    /// `limit` bytes (else `tooLong`), visible ASCII, no `.` or `..` component, naming a file.
    static func fileProblem(_ path: String, limit: Int, _ tooLong: String) -> String? {
        guard path.hasPrefix("/") else { return "needs an absolute path" }
        guard path.utf8.count <= limit else { return tooLong }
        guard path.utf8.allSatisfy({ $0 > 0x20 && $0 < 0x7F }) else { return "only visible ASCII characters, no spaces" }
        guard !path.hasSuffix("/"), !path.split(separator: "/").contains(where: { $0 == "." || $0 == ".." }) else {
            return "names no file (a directory, or a . or .. component)"
        }
        return nil
    }

    /// The most sessions one delegation exposes, delegations one daemon has.
    public static let mostSessions = 256
    public static let mostDelegations = 1024
}
