#if canImport(Glibc)
import Glibc
#endif
import Basics
import CLinux
import Synchronization

extension VarlinkServer {
    // The loop: its state lives on the loop thread only.
    struct Loop {
        let server: VarlinkServer
        var connections: [UInt64: Connection] = [:]
        /// Connections per uid, privileged peers' not counted.
        var perUser: [UInt32: Int] = [:]
        /// Extra listeners by id, with the connections open through each.
        var listeners: [UInt32: (listener: VarlinkServer.Listener, open: Int)] = [:]
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
                    case VarlinkServer.listenerToken: acceptAll(from: server.listenFD, listener: 0)
                    case _ where token & VarlinkServer.extraListenerBit != 0:
                        let id = UInt32(truncatingIfNeeded: token)
                        if let fd = listeners[id]?.listener.fd { acceptAll(from: fd, listener: id) }
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
            for (listener, _) in listeners.values { close(listener.fd) }
            listeners.removeAll()
            close(spareFD)
            close(server.epollFD)
            // Added or removal asked for after the loop's last look: done with too, in the same
            // hold of the lock that closes the inbox (none can come after).
            let (added, removed) = server.inbox.withLock { inbox in
                defer { (inbox.added, inbox.removed) = ([], []) }
                inbox.closed = true
                close(server.wakeFD)
                return (inbox.added, inbox.removed)
            }
            for listener in added { close(listener.fd) }
            for removal in removed { removal.done.resume() }
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
            for (listener, _) in listeners.values {
                epoll_ctl(server.epollFD, EPOLL_CTL_DEL, listener.fd, nil)
                close(listener.fd)
            }
            listeners.removeAll()
        }

        /// Serves the extra listeners added, and ends the ones removed (their connections with them).
        private mutating func changeListeners(added: [VarlinkServer.Listener], removed: [(id: UInt32, done: CheckedContinuation<Void, Never>)]) {
            for listener in added {
                var event = epoll_event()
                tb_epoll_event_set(&event, EPOLLIN.rawValue, VarlinkServer.extraListenerBit | UInt64(listener.id))
                // (Not while the server stops accepting; a second one with an id in use replaces nothing.)
                guard accepting, listeners[listener.id] == nil, epoll_ctl(server.epollFD, EPOLL_CTL_ADD, listener.fd, &event) == 0 else {
                    close(listener.fd)
                    continue
                }
                listeners[listener.id] = (listener, 0)
            }
            for removal in removed {
                if let (listener, _) = listeners.removeValue(forKey: removal.id) {
                    epoll_ctl(server.epollFD, EPOLL_CTL_DEL, listener.fd, nil)
                    close(listener.fd)
                }
                for connection in Array(connections.values) where connection.listener == removal.id { closeConnection(connection) }
                removal.done.resume()
            }
        }

        /// Returns true when the loop must end.
        private mutating func drainInbox() -> Bool {
            let (completions, stopAccepting, stop, added, removed) = server.inbox.withLock { inbox in
                defer {
                    inbox.completions.removeAll(keepingCapacity: true)
                    (inbox.added, inbox.removed) = ([], [])
                }
                return (inbox.completions, inbox.stopAccepting, inbox.stop, inbox.added, inbox.removed)
            }
            if stop {
                // (The shutdown closes what was added and tells who waits for a removal.)
                server.inbox.withLock { inbox in
                    inbox.added += added
                    inbox.removed += removed
                }
                return true
            }
            if stopAccepting && accepting { stopListening() }
            if !added.isEmpty || !removed.isEmpty { changeListeners(added: added, removed: removed) }
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
                    if !call.more { server.callEnded() }
                }
                pump(connection)
            }
            return false
        }

        /// Accepts on `listenFD`, the server's own listener (`listener` 0) or an extra one.
        private mutating func acceptAll(from listenFD: Int32, listener: UInt32) {
            // A bounded batch per wake-up (the listener is level-triggered): a peer reconnecting
            // as fast as it is refused must not keep the loop from everyone else.
            var batch = 0
            while accepting && batch < 64 {
                batch += 1
                let fd = tb_accept_nonblocking(listenFD)
                if fd < 0 {
                    if errno == EINTR || errno == ECONNABORTED { continue }
                    if errno == EMFILE || errno == ENFILE {
                        // Out of descriptors: accept with the spare one and close at once, so
                        // the pending connection does not keep the loop spinning.
                        server.onEvent(.connectionRefused(nil, .descriptors))
                        close(spareFD)
                        let pending = tb_accept_nonblocking(listenFD)
                        if pending >= 0 { close(pending) }
                        spareFD = open("/dev/null", O_RDONLY | O_CLOEXEC)
                        if pending >= 0 { continue }
                    }
                    return   // EAGAIN: nothing more to accept
                }
                guard var peer = UnixSocket.peer(fd) else {
                    close(fd)
                    continue
                }
                peer.listener = listener
                let limits = server.configuration
                // Through an extra listener nobody is privileged: it was made for others.
                let privileged = listener == 0 && limits.isPrivileged(peer)
                // The last `reservedConnections` slots are for privileged peers; each other uid
                // may hold `maximumConnectionsPerUser`.
                let refusal: VarlinkServerEvent.Refusal?
                if connections.count >= limits.maximumConnections
                    || (!privileged && connections.count >= limits.maximumConnections - limits.reservedConnections) {
                    refusal = .serverFull
                } else if !privileged && listener == 0 && perUser[peer.uid, default: 0] >= limits.maximumConnectionsPerUser {
                    refusal = .userLimit
                } else if listener != 0, let (extra, open) = listeners[listener], open >= extra.maximumConnections {
                    refusal = .listenerFull
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
                // (A delegation's connections are bounded by its own limit: its peers' uids are
                // theirs to choose, and must not use up the host users' share.)
                if !privileged && listener == 0 { perUser[peer.uid, default: 0] += 1 }
                if listener != 0 { listeners[listener]?.open += 1 }
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
                if let memo = connection.remembered(frame) {
                    dispatch(memo.call, memo.route, on: connection)
                    continue
                }
                let call: VarlinkCall
                do {
                    call = try VarlinkCall.decode(frame, limits: server.configuration.jsonLimits)
                } catch {
                    protocolError(connection, error.reason)
                    return false
                }
                let route = self.route(call)
                connection.memo = frame.count <= Connection.memoLimit ? Connection.Memo(frame: frame, call: call, route: route) : nil
                dispatch(call, route, on: connection)
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

        /// Where a call goes: worked out once per distinct call of a connection (`Connection.memo`).
        enum Route {
            case service
            case handler
            case unknownInterface
            case unknownMethod
        }

        private func route(_ call: VarlinkCall) -> Route {
            if call.interface == "org.varlink.service" { return .service }
            guard let interface = server.interfaces.first(where: { $0.name == call.interface }) else { return .unknownInterface }
            return interface.methods.contains(call.member) ? .handler : .unknownMethod
        }

        private mutating func dispatch(_ call: VarlinkCall, _ route: Route, on connection: Connection) {
            let handling: VarlinkHandling
            switch route {
            case .service:
                handling = .reply(server.serviceReply(call))
            case .unknownMethod:
                handling = .reply(.error(VarlinkServiceError.methodNotFound, ["method": .string(call.method)]))
            case .handler where call.upgrade:
                handling = .reply(.error(VarlinkServiceError.methodNotImplemented, ["method": .string(call.method)]))
            case .handler:
                handling = server.handler.handle(call, from: connection.peer)
            case .unknownInterface:
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
            if !connection.privileged && connection.listener == 0 {
                let held = perUser[connection.peer.uid, default: 1] - 1
                perUser[connection.peer.uid] = held > 0 ? held : nil
            }
            if connection.listener != 0 { listeners[connection.listener]?.open -= 1 }
            if let call = connection.current {
                call.task.cancel()
                if !call.more { server.callEnded() }
            }
            epoll_ctl(server.epollFD, EPOLL_CTL_DEL, connection.fd, nil)
            close(connection.fd)
            server.openConnections.subtract(1, ordering: .relaxed)
        }
    }
}
