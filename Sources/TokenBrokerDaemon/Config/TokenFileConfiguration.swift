import BrokerContract

/// An `[Output]` (or the file of a delegation made with `ctl delegate --file`): one session's
/// current token kept in a file, for batch jobs and programs that read a token from a file
/// (`BEARER_TOKEN_FILE`, HTCondor, Vault Agent-style sinks). The file is written atomically
/// (a temporary file in the same directory, fsync, rename), never through a symlink nor into a
/// directory others can write, renewed as the session refreshes ahead, and zeroed and removed
/// at a logout of the session and when the output ends.
public struct TokenFileConfiguration: Sendable, Equatable {
    /// Its name (`ctl delegations`, `ctl undelegate`): a delegation's and an output's share one
    /// namespace.
    public var name: String
    /// The session whose token it holds.
    public var session: String = ""
    /// Where the file is kept (an absolute path).
    public var path: String = ""
    public var format: TokenFileFormat = .token
    /// Owner and group of the file (the daemon's when nil; another owner needs a daemon that
    /// runs as root).
    public var user: UInt32?
    public var group: UInt32?
    public var mode: UInt32 = 0o600
    /// Users who may read it besides its owner and group, by uid: a POSIX ACL entry each.
    public var readers: [UInt32] = []
    /// When it ends by itself (Unix seconds); nil: when it is removed.
    public var expiresAt: Int64?

    public init(name: String) { self.name = name }

    /// What is wrong with `path` as a token file's path, if anything: absolute, visible ASCII,
    /// no `.` or `..` component, naming a file.
    public static func pathProblem(_ path: String) -> String? {
        if let problem = DelegationConfiguration.fileProblem(path, limit: 4095, "longer than a path may be") { return problem }
        guard let last = path.split(separator: "/").last, last.utf8.count <= 200 else { return "its file name is longer than 200 bytes" }
        return nil
    }

    /// The bits a token file's mode may have: reading, and its owner's writing (nobody else
    /// may change what its readers take for the session's token).
    public static let modeBits: UInt32 = 0o644

    /// The most files one daemon keeps, readers one file has.
    public static let mostFiles = 1024
    public static let mostReaders = 32
}
