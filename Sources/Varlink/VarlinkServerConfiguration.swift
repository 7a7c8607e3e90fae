import WireJSON

/// Limits of a varlink server: what one client may cost it. Every one of them is enforced on the
/// I/O thread before any handler runs, so no peer — authorized or not — can take more than its
/// share of connections, memory or the loop's time.
public struct VarlinkServerConfiguration: Sendable {
    /// Largest message accepted; a longer one closes its connection.
    public var maximumMessageSize: Int
    /// How much structure one message may have (nesting, members per object). Parsing is
    /// linear in the message's size whatever it holds.
    public var jsonLimits: JSONLimits
    /// Connections served at once; beyond it a new connection is accepted and closed at once.
    public var maximumConnections: Int
    /// Of `maximumConnections`, this many are kept for privileged peers (see `isPrivileged`): a
    /// flood of ordinary peers cannot lock the operator out.
    public var reservedConnections: Int
    /// Connections one uid may hold at once (privileged peers excepted).
    public var maximumConnectionsPerUser: Int
    /// Which peers are exempt from the per-uid limit and may use the reserved connections.
    public var isPrivileged: @Sendable (PeerCredentials) -> Bool
    /// A message whose first byte has arrived must be complete within this time, or its
    /// connection is closed (a half-sent message holds memory and a slot).
    public var messageTimeout: Duration
    /// Replies queued for a client that does not read; past it the server stops reading that
    /// client's calls (and drops a stream whose events keep coming).
    public var maximumPendingOutput: Int
    /// Replies queued for all clients together; past it, no client with replies still queued is
    /// read from until they drain (those that read their replies go on).
    public var maximumQueuedOutput: Int
    /// Bytes of calls received and not yet handled, all clients together (each holds at most
    /// one message's worth); past it, no client that has a message still unfinished is read
    /// from — its message deadline then ends it — while the others go on.
    public var maximumBufferedInput: Int
    /// An error sent before closing a connection over a malformed or oversized message, when no
    /// call of that connection is in progress (`nil`: close without a word). It carries
    /// `reason`.
    public var protocolErrorName: String?
    /// Called on the I/O thread at least this often while the loop runs (the systemd
    /// watchdog ping: a wedged loop stops calling it).
    public var heartbeat: (interval: Duration, action: @Sendable () -> Void)?

    public init(maximumMessageSize: Int = 64 << 10, jsonLimits: JSONLimits = .standard, maximumConnections: Int = 4096,
                reservedConnections: Int? = nil, maximumConnectionsPerUser: Int = 256,
                isPrivileged: @escaping @Sendable (PeerCredentials) -> Bool = { $0.uid == 0 },
                messageTimeout: Duration = .seconds(10), maximumPendingOutput: Int = 1 << 20, maximumQueuedOutput: Int = 32 << 20,
                maximumBufferedInput: Int = 32 << 20,
                protocolErrorName: String? = nil, heartbeat: (interval: Duration, action: @Sendable () -> Void)? = nil) {
        self.maximumMessageSize = maximumMessageSize
        self.jsonLimits = jsonLimits
        self.maximumConnections = maximumConnections
        self.reservedConnections = reservedConnections ?? Self.reserve(for: maximumConnections)
        self.maximumConnectionsPerUser = maximumConnectionsPerUser
        self.isPrivileged = isPrivileged
        self.messageTimeout = messageTimeout
        self.maximumPendingOutput = maximumPendingOutput
        self.maximumQueuedOutput = maximumQueuedOutput
        self.maximumBufferedInput = maximumBufferedInput
        self.protocolErrorName = protocolErrorName
        self.heartbeat = heartbeat
    }

    /// The connections kept for privileged peers by default: 1/32 of them, at least 1 and at
    /// most 128 (none when there is only one).
    public static func reserve(for maximumConnections: Int) -> Int {
        maximumConnections < 2 ? 0 : min(128, max(1, maximumConnections / 32))
    }
}

/// Something the server wants the operator to know (refusals, protocol errors). Holds no
/// message content.
public enum VarlinkServerEvent: Sendable {
    /// Why a connection was closed as soon as it was accepted.
    public enum Refusal: Sendable, Equatable {
        /// Every connection is taken (or every one not kept for privileged peers).
        case serverFull
        /// This peer's uid holds as many connections as it may.
        case userLimit
        /// The process is out of file descriptors.
        case descriptors
        /// The extra listener it came through holds as many connections as it may.
        case listenerFull
    }

    case connectionRefused(PeerCredentials?, Refusal)
    case protocolError(PeerCredentials, String)
}
