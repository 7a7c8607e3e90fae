#if canImport(Glibc)
import Glibc
#endif
import Basics
import CLinux
import Synchronization

/// A varlink service on one listening socket.
///
/// One epoll loop on its own thread accepts, reads, parses and answers. Calls the handler
/// answers at once are answered inline; the others run in a task that posts its replies back
/// to the loop. Each connection handles one call at a time, so replies leave in call order;
/// pipelined calls wait in the connection's bounded input buffer. A client that closes its
/// connection cancels only its own task.
public final class VarlinkServer: Sendable {
    let listenFD: Int32
    let epollFD: Int32
    let wakeFD: Int32
    let configuration: VarlinkServerConfiguration
    let info: VarlinkServiceInfo
    let interfaces: [VarlinkInterface]
    let handler: any VarlinkHandler
    let onEvent: @Sendable (VarlinkServerEvent) -> Void

    /// Work posted to the loop by tasks and by `stop()`.
    let inbox = Mutex<Inbox>(Inbox())
    /// Async calls in progress, streams (`more`) excepted — for draining at shutdown.
    let busyCalls = Atomic<Int>(0)
    /// Who waits for `busyCalls` to reach zero (`callsDrained`).
    let drainWaiters = Mutex<[Latch]>([])
    let openConnections = Atomic<Int>(0)
    let stopped = Mutex<[CheckedContinuation<Void, Never>]?>([])

    struct Inbox {
        var completions: [Completion] = []
        /// Extra listeners to serve, and to stop serving (each told when it is done).
        var added: [Listener] = []
        var removed: [(id: UInt32, done: CheckedContinuation<Void, Never>)] = []
        var stopAccepting = false
        var stop = false
        /// The loop has ended and closed the wake-up descriptor: nothing may write to it (its
        /// number may already belong to another file).
        var closed = false
    }

    struct Completion {
        var connection: UInt64
        var call: UInt64
        /// A reply to send, or `nil` when the call's task has returned.
        var reply: VarlinkReply?
    }

    static let listenerToken: UInt64 = 0
    static let wakeToken: UInt64 = 1
    /// Extra listeners' epoll tokens: this bit and their id (connections count up from 2).
    static let extraListenerBit: UInt64 = 1 << 63

    /// A listening socket served beside the server's own (`addListener`).
    struct Listener: Sendable {
        var id: UInt32
        var fd: Int32
        /// Connections it may have open at once.
        var maximumConnections: Int
    }

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

    /// Serves another listening socket on the same loop: its peers carry `id` (never 0) as
    /// their `PeerCredentials.listener`, none is privileged (no reserved connections, the
    /// per-uid limit for root too), and at most `maximumConnections` are open on it at once.
    /// The server owns `fd` from now on.
    public func addListener(_ fd: Int32, id: UInt32, maximumConnections: Int) throws(SocketError) {
        precondition(id != 0, "listener 0 is the server's own")
        do {
            try UnixSocket.setNonBlocking(fd)
        } catch {
            close(fd)
            throw error
        }
        let posted = inbox.withLock { inbox -> Bool in
            guard !inbox.closed, !inbox.stop else { return false }
            inbox.added.append(Listener(id: id, fd: fd, maximumConnections: max(1, maximumConnections)))
            wake(inbox)
            return true
        }
        if !posted {
            close(fd)
            throw SocketError("the server has stopped")
        }
    }

    /// Stops serving the listener `id`: closes it and every connection made through it
    /// (cancelling their calls); returns once the loop has (at once when there is none).
    public func removeListener(id: UInt32) async {
        await withCheckedContinuation { (continuation: CheckedContinuation<Void, Never>) in
            let posted = inbox.withLock { inbox -> Bool in
                guard !inbox.closed else { return false }
                inbox.removed.append((id, continuation))
                wake(inbox)
                return true
            }
            if !posted { continuation.resume() }
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

    /// Waits until no call is in progress (streams aside), at most `timeout`; returns whether
    /// none is. No polling: the loop signals the moment the last one ends.
    public func callsDrained(within timeout: Duration) async -> Bool {
        let latch = Latch()
        let idle = drainWaiters.withLock { waiters -> Bool in
            guard busyCalls.load(ordering: .acquiring) > 0 else { return true }
            waiters.append(latch)
            return false
        }
        if idle { return true }
        return await latch.wait(upTo: timeout)
    }

    /// A call (not a stream) has ended: when it was the last, the drain waiters are told.
    func callEnded() {
        guard busyCalls.subtract(1, ordering: .acquiringAndReleasing).newValue == 0 else { return }
        for latch in drainWaiters.withLock({ waiters in defer { waiters.removeAll() }; return waiters }) { latch.fire() }
    }

    /// Connections open now.
    public var connectionCount: Int { openConnections.load(ordering: .relaxed) }

    /// Wakes the loop; called with the inbox locked, so it never races the loop's close.
    func wake(_ inbox: borrowing Inbox) {
        guard !inbox.closed else { return }
        var one: UInt64 = 1
        _ = write(wakeFD, &one, 8)
    }

    func post(_ completion: Completion) {
        inbox.withLock { inbox in
            guard !inbox.closed else { return }   // the server has stopped: nobody to answer
            inbox.completions.append(completion)
            wake(inbox)
        }
    }
}
