#if canImport(Glibc)
import Glibc
#endif
import Basics
import CLinux
import Synchronization

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
    }

    case connectionRefused(PeerCredentials?, Refusal)
    case protocolError(PeerCredentials, String)
}

/// A varlink service on one listening socket.
///
/// One epoll loop on its own thread accepts, reads, parses and answers. Calls the handler
/// answers at once are answered inline; the others run in a task that posts its replies back
/// to the loop. Each connection handles one call at a time, so replies leave in call order;
/// pipelined calls wait in the connection's bounded input buffer. A client that closes its
/// connection cancels only its own task.
public final class VarlinkServer: Sendable {
    private let listenFD: Int32
    private let epollFD: Int32
    private let wakeFD: Int32
    private let configuration: VarlinkServerConfiguration
    private let info: VarlinkServiceInfo
    private let interfaces: [VarlinkInterface]
    private let handler: any VarlinkHandler
    private let onEvent: @Sendable (VarlinkServerEvent) -> Void

    /// Work posted to the loop by tasks and by `stop()`.
    private let inbox = Mutex<Inbox>(Inbox())
    /// Async calls in progress, streams (`more`) excepted — for draining at shutdown.
    private let busyCalls = Atomic<Int>(0)
    private let openConnections = Atomic<Int>(0)
    private let stopped = Mutex<[CheckedContinuation<Void, Never>]?>([])

    private struct Inbox {
        var completions: [Completion] = []
        var stopAccepting = false
        var stop = false
        /// The loop has ended and closed the wake-up descriptor: nothing may write to it (its
        /// number may already belong to another file).
        var closed = false
    }

    fileprivate struct Completion {
        var connection: UInt64
        var call: UInt64
        /// A reply to send, or `nil` when the call's task has returned.
        var reply: VarlinkReply?
    }

    private static let listenerToken: UInt64 = 0
    private static let wakeToken: UInt64 = 1

    /// Serves on `listenFD`, an AF_UNIX stream socket that already listens (bound by the caller,
    /// or passed by systemd). The server owns it from now on and makes it non-blocking.
    public init(listening listenFD: Int32, info: VarlinkServiceInfo, interfaces: [VarlinkInterface],
                handler: any VarlinkHandler, configuration: VarlinkServerConfiguration = VarlinkServerConfiguration(),
                onEvent: @escaping @Sendable (VarlinkServerEvent) -> Void = { _ in }) throws(SocketError) {
        try UnixSocket.setNonBlocking(listenFD)
        let epollFD = epoll_create1(Int32(EPOLL_CLOEXEC))
        guard epollFD >= 0 else { throw SocketError("epoll_create1") }
        let wakeFD = eventfd(0, Int32(EFD_NONBLOCK | EFD_CLOEXEC))
        guard wakeFD >= 0 else {
            close(epollFD)
            throw SocketError("eventfd")
        }
        self.listenFD = listenFD
        self.epollFD = epollFD
        self.wakeFD = wakeFD
        self.configuration = configuration
        self.info = info
        self.interfaces = interfaces
        self.handler = handler
        self.onEvent = onEvent
        var event = epoll_event()
        tb_epoll_event_set(&event, EPOLLIN.rawValue, Self.listenerToken)
        epoll_ctl(epollFD, EPOLL_CTL_ADD, listenFD, &event)
        tb_epoll_event_set(&event, EPOLLIN.rawValue, Self.wakeToken)
        epoll_ctl(epollFD, EPOLL_CTL_ADD, wakeFD, &event)
    }

    /// Starts the loop on its own thread.
    public func start() {
        spawnThread { [self] in
            var loop = Loop(server: self)
            loop.run()
        }
    }

    /// Stops accepting new connections; existing ones are still served.
    public func stopAccepting() {
        inbox.withLock { inbox in
            inbox.stopAccepting = true
            wake(inbox)
        }
    }

    /// Closes every connection (cancelling their tasks) and ends the loop; returns when it has.
    public func stop() async {
        await withCheckedContinuation { (continuation: CheckedContinuation<Void, Never>) in
            let alreadyStopped = stopped.withLock { waiters -> Bool in
                guard waiters != nil else { return true }
                waiters!.append(continuation)
                return false
            }
            if alreadyStopped {
                continuation.resume()
                return
            }
            inbox.withLock { inbox in
                inbox.stop = true
                wake(inbox)
            }
        }
    }

    /// Calls whose task has not returned yet, not counting streams (`more` calls), which may
    /// last as long as their client wants: a drain at shutdown waits for the others only.
    public var callsInProgress: Int { busyCalls.load(ordering: .relaxed) }

    /// Connections open now.
    public var connectionCount: Int { openConnections.load(ordering: .relaxed) }

    /// Wakes the loop; called with the inbox locked, so it never races the loop's close.
    private func wake(_ inbox: borrowing Inbox) {
        guard !inbox.closed else { return }
        var one: UInt64 = 1
        _ = write(wakeFD, &one, 8)
    }

    fileprivate func post(_ completion: Completion) {
        inbox.withLock { inbox in
            guard !inbox.closed else { return }   // the server has stopped: nobody to answer
            inbox.completions.append(completion)
            wake(inbox)
        }
    }

    // MARK: - The loop (its state lives on the loop thread only)

    private final class Connection {
        let id: UInt64
        let fd: Int32
        let peer: PeerCredentials
        /// Exempt from the per-uid limit (decided once, at accept).
        let privileged: Bool
        var decoder: FrameDecoder
        /// When the first byte of the message still unfinished arrived, in `Loop.milliseconds()`
        /// (`nil`: none is).
        var messageStarted: Int64?
        var output: [UInt8] = []
        var outputStart = 0
        /// Events registered with epoll.
        var interest: UInt32 = EPOLLIN.rawValue
        /// The client has shut down its side; finish what is pending, then close.
        var inputClosed = false
        /// Close once the output is flushed.
        var closeAfterFlush = false
        var current: Call?
        var nextCall: UInt64 = 0

        struct Call {
            var id: UInt64
            var method: String
            var oneway: Bool
            var more: Bool
            var task: Task<Void, Never>
            var finalSent = false
        }

        init(id: UInt64, fd: Int32, peer: PeerCredentials, privileged: Bool, maximumMessageSize: Int) {
            self.id = id
            self.fd = fd
            self.peer = peer
            self.privileged = privileged
            decoder = FrameDecoder(maximumSize: maximumMessageSize)
        }

        var pendingOutput: Int { output.count - outputStart }
    }

    private struct Loop {
        let server: VarlinkServer
        var connections: [UInt64: Connection] = [:]
        /// Connections per uid, privileged peers' not counted.
        var perUser: [UInt32: Int] = [:]
        /// Bytes of replies queued on all connections together.
        var queuedOutput = 0
        /// Bytes of calls received and not yet handled, all connections together.
        var bufferedInput = 0
        var nextID: UInt64 = 2
        var accepting = true
        var readBuffer = [UInt8](repeating: 0, count: 65_536)
        /// A descriptor held in reserve for accepting (and refusing) when the process runs out.
        var spareFD = open("/dev/null", O_RDONLY | O_CLOEXEC)

        init(server: VarlinkServer) { self.server = server }

        mutating func run() {
            var events = [epoll_event](repeating: epoll_event(), count: 256)
            let heartbeat = server.configuration.heartbeat
            // Timers in whole milliseconds of the coarse monotonic clock: read once per wake-up,
            // the cheapest clock there is (this loop is the hot path).
            let beatInterval = heartbeat.map { max(1, Self.milliseconds($0.interval)) } ?? 0
            var nextBeat = heartbeat == nil ? Int64.max / 4 : Self.milliseconds()
            // Unfinished messages are checked this often against their deadline.
            let sweepInterval = min(1000, max(1, Self.milliseconds(server.configuration.messageTimeout) / 4))
            var nextSweep = Self.milliseconds() + sweepInterval
            while true {
                let now = Self.milliseconds()
                if let heartbeat, now >= nextBeat {
                    heartbeat.action()
                    nextBeat = now + beatInterval
                }
                if now >= nextSweep {
                    closeUnfinished(now: now)
                    nextSweep = now + sweepInterval
                }
                let timeout = Int32(max(1, min(nextSweep, nextBeat) - now))
                let count = epoll_wait(server.epollFD, &events, Int32(events.count), timeout)
                if count < 0 {
                    if errno == EINTR { continue }
                    break
                }
                for index in 0..<Int(count) {
                    let token = tb_epoll_event_data(&events[index])
                    let flags = tb_epoll_event_events(&events[index])
                    switch token {
                    case VarlinkServer.listenerToken: acceptAll()
                    case VarlinkServer.wakeToken:
                        var value: UInt64 = 0
                        _ = read(server.wakeFD, &value, 8)
                        if drainInbox() { return shutdown() }
                    default:
                        guard let connection = connections[token] else { continue }
                        service(connection, flags: flags)
                    }
                }
            }
            shutdown()
        }

        private mutating func shutdown() {
            for connection in Array(connections.values) { closeConnection(connection) }
            if accepting { stopListening() }
            close(spareFD)
            close(server.epollFD)
            server.inbox.withLock { inbox in
                inbox.closed = true
                close(server.wakeFD)
            }
            let waiters = server.stopped.withLock { waiters in
                defer { waiters = nil }
                return waiters ?? []
            }
            for waiter in waiters { waiter.resume() }
        }

        /// Now, in milliseconds of CLOCK_MONOTONIC_COARSE (a few ms of resolution is plenty for
        /// timeouts of seconds).
        static func milliseconds() -> Int64 {
            var now = timespec()
            clock_gettime(CLOCK_MONOTONIC_COARSE, &now)
            return Int64(now.tv_sec) * 1000 + Int64(now.tv_nsec) / 1_000_000
        }

        static func milliseconds(_ duration: Duration) -> Int64 {
            duration.components.seconds * 1000 + duration.components.attoseconds / 1_000_000_000_000_000
        }

        private mutating func stopListening() {
            accepting = false
            epoll_ctl(server.epollFD, EPOLL_CTL_DEL, server.listenFD, nil)
            close(server.listenFD)
        }

        /// Returns true when the loop must end.
        private mutating func drainInbox() -> Bool {
            let (completions, stopAccepting, stop) = server.inbox.withLock { inbox in
                defer { inbox.completions.removeAll(keepingCapacity: true) }
                return (inbox.completions, inbox.stopAccepting, inbox.stop)
            }
            if stop { return true }
            if stopAccepting && accepting { stopListening() }
            for completion in completions {
                guard let connection = connections[completion.connection],
                      var call = connection.current, call.id == completion.call else { continue }
                if let reply = completion.reply {
                    // Only `more` calls may have several replies; nothing after the final one.
                    guard !call.finalSent else { continue }
                    var reply = reply
                    if !call.more || reply.error != nil { reply.continues = false }
                    if !reply.continues { call.finalSent = true }
                    connection.current = call
                    if !call.oneway { queue(reply, on: connection) }
                    if connection.pendingOutput > server.configuration.maximumPendingOutput * 2 {
                        // A stream nobody reads: drop the connection, not the server's memory.
                        closeConnection(connection)
                        continue
                    }
                } else {
                    if !call.finalSent && !call.oneway {
                        queue(.error(VarlinkServiceError.methodNotImplemented, ["method": .string(call.method)]), on: connection)
                    }
                    connection.current = nil
                    if !call.more { server.busyCalls.subtract(1, ordering: .relaxed) }
                }
                pump(connection)
            }
            return false
        }

        private mutating func acceptAll() {
            // A bounded batch per wake-up (the listener is level-triggered): a peer reconnecting
            // as fast as it is refused must not keep the loop from everyone else.
            var batch = 0
            while accepting && batch < 64 {
                batch += 1
                let fd = tb_accept_nonblocking(server.listenFD)
                if fd < 0 {
                    if errno == EINTR || errno == ECONNABORTED { continue }
                    if errno == EMFILE || errno == ENFILE {
                        // Out of descriptors: accept with the spare one and close at once, so
                        // the pending connection does not keep the loop spinning.
                        server.onEvent(.connectionRefused(nil, .descriptors))
                        close(spareFD)
                        let pending = tb_accept_nonblocking(server.listenFD)
                        if pending >= 0 { close(pending) }
                        spareFD = open("/dev/null", O_RDONLY | O_CLOEXEC)
                        if pending >= 0 { continue }
                    }
                    return   // EAGAIN: nothing more to accept
                }
                guard let peer = UnixSocket.peer(fd) else {
                    close(fd)
                    continue
                }
                let limits = server.configuration
                let privileged = limits.isPrivileged(peer)
                // The last `reservedConnections` slots are for privileged peers; each other uid
                // may hold `maximumConnectionsPerUser`.
                let refusal: VarlinkServerEvent.Refusal?
                if connections.count >= limits.maximumConnections
                    || (!privileged && connections.count >= limits.maximumConnections - limits.reservedConnections) {
                    refusal = .serverFull
                } else if !privileged && perUser[peer.uid, default: 0] >= limits.maximumConnectionsPerUser {
                    refusal = .userLimit
                } else {
                    refusal = nil
                }
                if let refusal {
                    server.onEvent(.connectionRefused(peer, refusal))
                    close(fd)
                    continue
                }
                let connection = Connection(id: nextID, fd: fd, peer: peer, privileged: privileged,
                                            maximumMessageSize: limits.maximumMessageSize)
                nextID += 1
                var event = epoll_event()
                tb_epoll_event_set(&event, EPOLLIN.rawValue | EPOLLRDHUP.rawValue, connection.id)
                guard epoll_ctl(server.epollFD, EPOLL_CTL_ADD, fd, &event) == 0 else {
                    close(fd)
                    continue
                }
                connection.interest = EPOLLIN.rawValue
                connections[connection.id] = connection
                if !privileged { perUser[peer.uid, default: 0] += 1 }
                server.openConnections.add(1, ordering: .relaxed)
            }
        }

        private mutating func service(_ connection: Connection, flags: UInt32) {
            if flags & (EPOLLERR.rawValue | EPOLLHUP.rawValue) != 0 {
                // The client is gone. Calls it managed to send are still dispatched (a
                // oneway call, say), then the connection closes and its task is cancelled.
                if flags & EPOLLIN.rawValue != 0 && wantsInput(connection) {
                    readAvailable(connection)
                    _ = processFrames(connection)
                }
                closeConnection(connection)
                return
            }
            if flags & EPOLLOUT.rawValue != 0 {
                flush(connection)
                guard connections[connection.id] != nil else { return }
            }
            if flags & (EPOLLIN.rawValue | EPOLLRDHUP.rawValue) != 0 && wantsInput(connection) {
                readAvailable(connection)
            }
            pump(connection)
        }

        /// Whether to read more from the client: not while its replies pile up, and at most
        /// about one message's worth of calls ahead of the one in progress.
        private func wantsInput(_ connection: Connection) -> Bool {
            guard !connection.inputClosed, !connection.closeAfterFlush, !outputBlocked(connection) else { return false }
            let pending = connection.decoder.pendingCount
            return pending <= server.configuration.maximumMessageSize && pending < inputAllowance
        }

        /// How much one connection may hold in its input buffer now: a message's worth and one
        /// read more (so that an oversized message is seen whole enough to be answered before the
        /// connection closes), or, once everyone's together is over budget, only a small call's
        /// (normal calls still pass).
        private var inputAllowance: Int {
            bufferedInput > server.configuration.maximumBufferedInput ? Self.smallCall : server.configuration.maximumMessageSize + readBuffer.count
        }

        /// What a connection may still send while input is over budget.
        static let smallCall = 4096

        /// Whether the client must take its replies before more of its calls are handled: its
        /// own queue is full, or everyone's together is and it has replies waiting.
        private func outputBlocked(_ connection: Connection) -> Bool {
            connection.pendingOutput > server.configuration.maximumPendingOutput
                || (connection.pendingOutput > 0 && queuedOutput > server.configuration.maximumQueuedOutput)
        }

        /// Queues a reply on `connection`, counting it in the total.
        private mutating func queue(_ reply: VarlinkReply, on connection: Connection) {
            let before = connection.output.count
            reply.encode(into: &connection.output)
            queuedOutput += connection.output.count - before
        }

        /// Handles buffered calls and writes replies until nothing more can happen without the
        /// client (more input, or room in the socket) or a task.
        private mutating func pump(_ connection: Connection) {
            while processFrames(connection) {
                // Stopped because replies piled up: write, and go on if the client took them.
                flush(connection)
                guard connections[connection.id] != nil, !outputBlocked(connection) else { return }
            }
            flush(connection)
        }

        private mutating func readAvailable(_ connection: Connection) {
            while true {
                // Never more than about one message's worth buffered per connection.
                let room = min(readBuffer.count, inputAllowance - connection.decoder.pendingCount)
                guard room > 0 else { return }
                let n = readBuffer.withUnsafeMutableBytes { read(connection.fd, $0.baseAddress, room) }
                if n > 0 {
                    readBuffer.withUnsafeBytes { connection.decoder.append(UnsafeRawBufferPointer(rebasing: $0[0..<n])) }
                    bufferedInput += n
                    // A message's deadline runs from its first byte to its NUL.
                    let unfinished = readBuffer[n - 1] != 0
                    if !unfinished || readBuffer.withUnsafeBytes({ memchr($0.baseAddress!, 0, n) != nil }) { connection.messageStarted = nil }
                    if unfinished && connection.messageStarted == nil { connection.messageStarted = Self.milliseconds() }
                    if n < room || !wantsInput(connection) { return }
                    continue
                }
                if n == 0 {
                    connection.inputClosed = true
                    return
                }
                if errno == EINTR { continue }
                if errno != EAGAIN && errno != EWOULDBLOCK { connection.inputClosed = true }
                return
            }
        }

        /// Handles buffered calls until one goes async, the input runs dry, the replies pile
        /// up (then returns true), or the connection ends.
        private mutating func processFrames(_ connection: Connection) -> Bool {
            let before = connection.decoder.pendingCount
            defer { bufferedInput -= before - connection.decoder.pendingCount }
            while connection.current == nil && !connection.closeAfterFlush {
                if outputBlocked(connection) { return true }
                let frame: ArraySlice<UInt8>
                do {
                    guard let next = try connection.decoder.next() else { break }
                    frame = next
                } catch {
                    protocolError(connection, "message larger than \(server.configuration.maximumMessageSize) bytes")
                    return false
                }
                let call: VarlinkCall
                do {
                    call = try VarlinkCall.decode(frame, limits: server.configuration.jsonLimits)
                } catch {
                    protocolError(connection, error.reason)
                    return false
                }
                dispatch(call, on: connection)
            }
            if connection.inputClosed && connection.current == nil && !connection.closeAfterFlush {
                connection.closeAfterFlush = true
            }
            return false
        }

        private mutating func protocolError(_ connection: Connection, _ reason: String) {
            server.onEvent(.protocolError(connection.peer, reason))
            if let name = server.configuration.protocolErrorName {
                queue(.error(name, ["reason": .string(reason)]), on: connection)
            }
            connection.closeAfterFlush = true
        }

        /// Closes the connections whose unfinished message has outlived `messageTimeout` (with a
        /// protocol error when nothing else is being answered on them; never waiting for a
        /// client that does not read).
        private mutating func closeUnfinished(now: Int64) {
            let timeout = server.configuration.messageTimeout
            let limit = Self.milliseconds(timeout)
            for connection in Array(connections.values) {
                guard let started = connection.messageStarted, now - started > limit else { continue }
                let reason = "message not completed within \(timeout)"
                if connection.current == nil && !connection.closeAfterFlush {
                    protocolError(connection, reason)
                    flush(connection)
                } else {
                    server.onEvent(.protocolError(connection.peer, reason))
                }
                closeConnection(connection)
            }
        }

        private mutating func dispatch(_ call: VarlinkCall, on connection: Connection) {
            let handling: VarlinkHandling
            if call.interface == "org.varlink.service" {
                handling = .reply(server.serviceReply(call))
            } else if let interface = server.interfaces.first(where: { $0.name == call.interface }) {
                if !interface.methods.contains(call.member) {
                    handling = .reply(.error(VarlinkServiceError.methodNotFound, ["method": .string(call.method)]))
                } else if call.upgrade {
                    handling = .reply(.error(VarlinkServiceError.methodNotImplemented, ["method": .string(call.method)]))
                } else {
                    handling = server.handler.handle(call, from: connection.peer)
                }
            } else {
                handling = .reply(.error(VarlinkServiceError.interfaceNotFound, ["interface": .string(call.interface)]))
            }
            switch handling {
            case var .reply(reply):
                guard !call.oneway else { return }
                if !call.more { reply.continues = false }
                queue(reply, on: connection)
            case let .async(body):
                connection.nextCall += 1
                let (server, connectionID, callID) = (server, connection.id, connection.nextCall)
                let sink = VarlinkReplySink { reply in server.post(.init(connection: connectionID, call: callID, reply: reply)) }
                if !call.more { server.busyCalls.add(1, ordering: .relaxed) }
                let task = Task {
                    await body(sink)
                    sink.finish()
                }
                connection.current = Connection.Call(id: connection.nextCall, method: call.method, oneway: call.oneway,
                                                     more: call.more, task: task)
            }
        }

        private mutating func flush(_ connection: Connection) {
            while connection.pendingOutput > 0 {
                let n = connection.output.withUnsafeBytes { bytes in
                    send(connection.fd, bytes.baseAddress! + connection.outputStart, connection.pendingOutput, Int32(MSG_NOSIGNAL))
                }
                if n > 0 {
                    connection.outputStart += n
                    queuedOutput -= n
                    continue
                }
                if n < 0 && errno == EINTR { continue }
                if n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) { break }
                closeConnection(connection)
                return
            }
            if connection.pendingOutput == 0 {
                connection.output.removeAll(keepingCapacity: connection.output.capacity <= 4096)
                connection.outputStart = 0
                if connection.closeAfterFlush {
                    closeConnection(connection)
                    return
                }
            } else if connection.outputStart > 65_536 {
                connection.output.removeSubrange(0..<connection.outputStart)
                connection.outputStart = 0
            }
            updateInterest(connection)
        }

        private func updateInterest(_ connection: Connection) {
            var wanted: UInt32 = 0
            if wantsInput(connection) { wanted |= EPOLLIN.rawValue | EPOLLRDHUP.rawValue }
            if connection.pendingOutput > 0 { wanted |= EPOLLOUT.rawValue }
            guard wanted != connection.interest else { return }
            var event = epoll_event()
            tb_epoll_event_set(&event, wanted, connection.id)
            epoll_ctl(server.epollFD, EPOLL_CTL_MOD, connection.fd, &event)
            connection.interest = wanted
        }

        private mutating func closeConnection(_ connection: Connection) {
            guard connections.removeValue(forKey: connection.id) != nil else { return }
            queuedOutput -= connection.pendingOutput
            bufferedInput -= connection.decoder.pendingCount
            if !connection.privileged {
                let held = perUser[connection.peer.uid, default: 1] - 1
                perUser[connection.peer.uid] = held > 0 ? held : nil
            }
            if let call = connection.current {
                call.task.cancel()
                if !call.more { server.busyCalls.subtract(1, ordering: .relaxed) }
            }
            epoll_ctl(server.epollFD, EPOLL_CTL_DEL, connection.fd, nil)
            close(connection.fd)
            server.openConnections.subtract(1, ordering: .relaxed)
        }
    }

    // MARK: - org.varlink.service

    private func serviceReply(_ call: VarlinkCall) -> VarlinkReply {
        let parameters = Parameters(call.parameters)
        switch call.member {
        case "GetInfo":
            do { try parameters.only([]) } catch { return error.reply }
            let names = ["org.varlink.service"] + interfaces.map(\.name)
            return VarlinkReply(parameters: [
                "vendor": .string(info.vendor), "product": .string(info.product), "version": .string(info.version),
                "url": .string(info.url), "interfaces": .array(names.map(JSON.string)),
            ])
        case "GetInterfaceDescription":
            let name: String
            do {
                try parameters.only(["interface"])
                name = try parameters.string("interface")
            } catch {
                return error.reply
            }
            if name == "org.varlink.service" { return VarlinkReply(parameters: ["description": .string(Self.serviceDescription)]) }
            guard let interface = interfaces.first(where: { $0.name == name }) else {
                return .error(VarlinkServiceError.interfaceNotFound, ["interface": .string(name)])
            }
            return VarlinkReply(parameters: ["description": .string(interface.description)])
        default:
            return .error(VarlinkServiceError.methodNotFound, ["method": .string(call.method)])
        }
    }

    /// The standard interface every varlink service implements.
    public static let serviceDescription = """
        # The Varlink Service Interface is provided by every varlink service. It
        # describes the service and the interfaces it implements.
        interface org.varlink.service

        # Get a list of all the interfaces a service provides and information
        # about the implementation.
        method GetInfo() -> (
          vendor: string,
          product: string,
          version: string,
          url: string,
          interfaces: []string
        )

        # Get the description of an interface that is implemented by this service.
        method GetInterfaceDescription(interface: string) -> (description: string)

        # The requested interface was not found.
        error InterfaceNotFound (interface: string)

        # The requested method was not found
        error MethodNotFound (method: string)

        # The interface defines the requested method, but the service does not
        # implement it.
        error MethodNotImplemented (method: string)

        # One of the passed parameters is invalid.
        error InvalidParameter (parameter: string)

        # Client is denied access
        error PermissionDenied ()

        # Method is expected to be called with 'more' set to true, but wasn't
        error ExpectedMore ()

        """
}

/// Where an async call sends its replies. Safe to use from any task; replies after the call
/// has ended, or for a connection that has closed, are dropped.
public final class VarlinkReplySink: Sendable {
    /// Receives each reply, then `nil` when the call's task has returned.
    private let deliver: @Sendable (VarlinkReply?) -> Void

    /// A sink that hands replies to `deliver` (the server's, or a test's).
    public init(_ deliver: @escaping @Sendable (VarlinkReply?) -> Void) {
        self.deliver = deliver
    }

    /// Sends a reply; for a `more` call, set `continues` on all but the last.
    public func send(_ reply: VarlinkReply) {
        deliver(reply)
    }

    /// Marks the call finished (the server does this when the handler's task returns).
    public func finish() {
        deliver(nil)
    }
}
