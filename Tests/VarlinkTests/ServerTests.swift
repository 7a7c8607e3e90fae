import Foundation
import Synchronization
import Testing
import TestSupport
import Varlink

/// A varlink service for exercising the server: `Echo` answers inline, `Slow` parks until the
/// test releases it, `Stream` sends `count` replies.
final class TestHandler: VarlinkHandler {
    static let interface = VarlinkInterface(description: """
        # A test interface.
        interface io.example.Test

        # Returns its argument.
        method Echo(text: string) -> (text: string)

        # Returns its argument once the test releases it.
        method Slow(id: int) -> (id: int)

        # Sends `count` replies (call with more).
        method Stream(count: int) -> (n: int)

        # Declared but not handled by the test handler.
        method Unhandled() -> ()

        """)

    private struct State {
        var parked: [Int64: CheckedContinuation<Void, Never>] = [:]
        var cancelled: Set<Int64> = []
    }

    private let state = Mutex(State())

    func handle(_ call: VarlinkCall, from peer: PeerCredentials) -> VarlinkHandling {
        let parameters = Parameters(call.parameters)
        switch call.member {
        case "Echo":
            do {
                try parameters.only(["text"])
                return .reply(VarlinkReply(parameters: ["text": .string(try parameters.string("text"))]))
            } catch {
                return .reply(error.reply)
            }
        case "Slow":
            guard let id = try? parameters.int("id") else { return .reply(.invalidParameter("id")) }
            return .async { [self] sink in
                await withTaskCancellationHandler {
                    await withCheckedContinuation { continuation in
                        state.withLock { $0.parked[id] = continuation }
                    }
                } onCancel: {
                    let continuation = state.withLock { state in
                        state.cancelled.insert(id)
                        return state.parked.removeValue(forKey: id)
                    }
                    continuation?.resume()
                }
                if !Task.isCancelled { sink.send(VarlinkReply(parameters: ["id": .int(id)])) }
            }
        case "Stream":
            guard let count = try? parameters.int("count") else { return .reply(.invalidParameter("count")) }
            return .async { sink in
                for n in 1...max(count, 1) {
                    sink.send(VarlinkReply(parameters: ["n": .int(n)], continues: n < count))
                }
            }
        default:
            return .async { _ in }
        }
    }

    func isParked(_ id: Int64) -> Bool { state.withLock { $0.parked[id] != nil } }
    func wasCancelled(_ id: Int64) -> Bool { state.withLock { $0.cancelled.contains(id) } }

    func release(_ id: Int64) {
        state.withLock { $0.parked.removeValue(forKey: id) }?.resume()
    }
}

/// A server on a temporary socket.
final class TestServer: Sendable {
    let directory: String
    let address: VarlinkAddress
    let handler = TestHandler()
    let server: VarlinkServer

    init(configuration: VarlinkServerConfiguration = VarlinkServerConfiguration(protocolErrorName: "io.example.Test.ProtocolError"),
         onEvent: @escaping @Sendable (VarlinkServerEvent) -> Void = { _ in }) throws {
        directory = try FileManager.default.url(for: .itemReplacementDirectory, in: .userDomainMask,
                                                 appropriateFor: URL(fileURLWithPath: NSTemporaryDirectory()), create: true).path
        address = VarlinkAddress(path: directory + "/test.sock")
        let fd = try UnixSocket.listen(path: address.path)
        server = try VarlinkServer(listening: fd, info: VarlinkServiceInfo(vendor: "tokenbroker", product: "test", version: "1", url: "https://example.invalid"),
                                   interfaces: [TestHandler.interface], handler: handler, configuration: configuration, onEvent: onEvent)
        server.start()
    }

    func client(timeout: Double = 10) throws -> VarlinkClient { try VarlinkClient(address: address, timeout: timeout) }

    func stop() async {
        await server.stop()
        try? FileManager.default.removeItem(atPath: directory)
    }
}

/// Whether a reply (or EOF) is readable on the client's socket within `milliseconds`.
func readable(_ client: VarlinkClient, milliseconds: Int32 = 0) -> Bool {
    var pfd = pollfd(fd: client.fileDescriptor, events: Int16(POLLIN), revents: 0)
    return poll(&pfd, 1, milliseconds) > 0
}

@Suite("VarlinkServer", .serialized)
struct ServerTests {
    @Test("org.varlink.service: GetInfo, GetInterfaceDescription byte for byte, standard errors")
    func service() async throws {
        let fixture = try TestServer()
        defer { Task { await fixture.stop() } }
        let client = try fixture.client()
        let info = try client.call("org.varlink.service.GetInfo")
        #expect(info.parameters["interfaces"] == ["org.varlink.service", "io.example.Test"])
        #expect(info.parameters["vendor"] == "tokenbroker" && info.parameters["url"] == "https://example.invalid")
        let description = try client.call("org.varlink.service.GetInterfaceDescription", ["interface": "io.example.Test"])
        #expect(description.parameters["description"]?.stringValue == TestHandler.interface.description)
        let service = try client.call("org.varlink.service.GetInterfaceDescription", ["interface": "org.varlink.service"])
        #expect(service.parameters["description"]?.stringValue == VarlinkServer.serviceDescription)

        #expect(try client.call("org.varlink.service.GetInterfaceDescription", ["interface": "io.nope.X"])
                == .error("org.varlink.service.InterfaceNotFound", ["interface": "io.nope.X"]))
        #expect(try client.call("org.varlink.service.GetInterfaceDescription", ["interface": 1]) == .invalidParameter("interface"))
        #expect(try client.call("org.varlink.service.GetInfo", ["x": 1]) == .invalidParameter("x"))
        #expect(try client.call("io.nope.X.Y") == .error("org.varlink.service.InterfaceNotFound", ["interface": "io.nope.X"]))
        #expect(try client.call("io.example.Test.Nope") == .error("org.varlink.service.MethodNotFound", ["method": "io.example.Test.Nope"]))
        #expect(try client.call("io.example.Test.Echo", ["text": 5]) == .invalidParameter("text"))
        #expect(try client.call("io.example.Test.Echo", ["text": "hi", "extra": true]) == .invalidParameter("extra"))
        #expect(try client.call("io.example.Test.Unhandled") == .error("org.varlink.service.MethodNotImplemented", ["method": "io.example.Test.Unhandled"]))
        #expect(try client.call("io.example.Test.Echo", ["text": "hi"]).parameters["text"] == "hi")
    }

    @Test("pipelined calls are answered strictly in call order, one at a time")
    func pipelining() async throws {
        let fixture = try TestServer()
        defer { Task { await fixture.stop() } }
        let client = try fixture.client()
        let calls = [VarlinkCall(method: "io.example.Test.Slow", parameters: ["id": 1]),
                     VarlinkCall(method: "io.example.Test.Echo", parameters: ["text": "second"]),
                     VarlinkCall(method: "io.example.Test.Slow", parameters: ["id": 2]),
                     VarlinkCall(method: "io.example.Test.Echo", parameters: ["text": "fourth"])]
        try client.send(calls.flatMap { $0.encoded() })
        try await eventually("Slow 1 parked") { fixture.handler.isParked(1) }
        #expect(!readable(client, milliseconds: 50))
        #expect(!fixture.handler.isParked(2))
        fixture.handler.release(1)
        #expect(try client.nextReply().parameters["id"] == 1)
        #expect(try client.nextReply().parameters["text"] == "second")
        try await eventually("Slow 2 parked") { fixture.handler.isParked(2) }
        #expect(!readable(client, milliseconds: 50))
        fixture.handler.release(2)
        #expect(try client.nextReply().parameters["id"] == 2)
        #expect(try client.nextReply().parameters["text"] == "fourth")
    }

    @Test("calls that arrive one byte at a time, and many calls in one write, are all answered")
    func dripAndBatch() async throws {
        let fixture = try TestServer()
        defer { Task { await fixture.stop() } }
        let client = try fixture.client()
        let call = VarlinkCall(method: "io.example.Test.Echo", parameters: ["text": "drip"]).encoded()
        for byte in call { try client.send([byte]) }
        #expect(try client.nextReply().parameters["text"] == "drip")
        let batch = (0..<200).flatMap { VarlinkCall(method: "io.example.Test.Echo", parameters: ["text": .string("\($0)")]).encoded() }
        try client.send(batch)
        for index in 0..<200 { #expect(try client.nextReply().parameters["text"] == .string("\(index)")) }
    }

    @Test("more streams: continues on all but the last; without more a single plain reply")
    func streams() async throws {
        let fixture = try TestServer()
        defer { Task { await fixture.stop() } }
        let client = try fixture.client()
        var replies = [try client.call("io.example.Test.Stream", ["count": 3], more: true)]
        while replies.last?.continues == true { replies.append(try client.nextReply()) }
        #expect(replies.map { $0.parameters["n"] } == [1, 2, 3])
        #expect(replies.map(\.continues) == [true, true, false])
        let single = try client.call("io.example.Test.Stream", ["count": 3])
        #expect(single.parameters["n"] == 1 && !single.continues)
        #expect(try client.call("io.example.Test.Echo", ["text": "after"]).parameters["text"] == "after")
    }

    @Test("a call sent again as the same bytes is answered as the first; a call one byte apart is read anew, flags, errors and other methods included")
    func repeatedCalls() async throws {
        let fixture = try TestServer()
        defer { Task { await fixture.stop() } }
        let client = try fixture.client()
        let first = VarlinkCall(method: "io.example.Test.Echo", parameters: ["text": "aa"])
        for _ in 0..<3 { #expect(try client.call(first).parameters["text"] == "aa") }
        #expect(try client.call("io.example.Test.Echo", ["text": "ab"]).parameters["text"] == "ab")
        #expect(try client.call(first).parameters["text"] == "aa")
        // The same method and parameters with a flag: no reply, then the plain call answers.
        try client.call(VarlinkCall(method: "io.example.Test.Echo", parameters: ["text": "aa"], oneway: true))
        #expect(try client.call(first).parameters["text"] == "aa")
        #expect(try client.call("io.example.Test.Echo", ["text": "aa", "extra": 1]).error == VarlinkServiceError.invalidParameter)
        for _ in 0..<2 { #expect(try client.call("io.example.Test.Nope").error == VarlinkServiceError.methodNotFound) }
        for _ in 0..<2 { #expect(try client.call("io.example.Other.Echo").error == VarlinkServiceError.interfaceNotFound) }
        #expect(try client.call(first).parameters["text"] == "aa")
        // Bytes that are not a call, after a remembered one, are still a protocol error.
        var broken = first.encoded()
        broken[broken.count - 2] = UInt8(ascii: ",")
        try client.send(broken)
        #expect(try client.nextReply().error == "io.example.Test.ProtocolError")
    }

    @Test("oneway calls get no reply")
    func oneway() async throws {
        let fixture = try TestServer()
        defer { Task { await fixture.stop() } }
        let client = try fixture.client()
        try client.call(VarlinkCall(method: "io.example.Test.Echo", parameters: ["text": "quiet"], oneway: true))
        try client.call(VarlinkCall(method: "io.example.Test.Nope", oneway: true))
        #expect(try client.call("io.example.Test.Echo", ["text": "loud"]).parameters["text"] == "loud")
    }

    @Test("malformed, oversized and invalid messages close only their own connection", arguments: [
        Array(#"{"method":"io.example.Test.Echo""#.utf8) + [0],
        Array("not json".utf8) + [0],
        Array(#"{"method":"io.example.Test.Echo","bogus":1}"#.utf8) + [0],
        Array(#"["method"]"#.utf8) + [0],
        Array(repeating: UInt8(ascii: " "), count: 2048),
    ])
    func badInput(bytes: [UInt8]) async throws {
        let fixture = try TestServer(configuration: VarlinkServerConfiguration(maximumMessageSize: 1024, protocolErrorName: "io.example.Test.ProtocolError"))
        defer { Task { await fixture.stop() } }
        let bystander = try fixture.client()
        let offender = try fixture.client()
        try offender.send(bytes)
        let reply = try offender.nextReply()
        #expect(reply.error == "io.example.Test.ProtocolError")
        #expect(throws: VarlinkClientError.closed) { try offender.nextReply() }
        #expect(try bystander.call("io.example.Test.Echo", ["text": "still here"]).parameters["text"] == "still here")
        try await eventually("offender closed") { fixture.server.connectionCount == 1 }
    }

    @Test("a client that disconnects cancels only its own call")
    func disconnectCancels() async throws {
        let fixture = try TestServer()
        defer { Task { await fixture.stop() } }
        var leaver: VarlinkClient? = try fixture.client()
        let stayer = try fixture.client()
        try leaver!.send(VarlinkCall(method: "io.example.Test.Slow", parameters: ["id": 7]).encoded())
        try stayer.send(VarlinkCall(method: "io.example.Test.Slow", parameters: ["id": 8]).encoded())
        try await eventually("both parked") { fixture.handler.isParked(7) && fixture.handler.isParked(8) }
        leaver = nil
        try await eventually("7 cancelled") { fixture.handler.wasCancelled(7) }
        #expect(!fixture.handler.wasCancelled(8))
        fixture.handler.release(8)
        #expect(try stayer.nextReply().parameters["id"] == 8)
        try await eventually("no call in progress") { fixture.server.callsInProgress == 0 }
    }

    @Test("beyond the connection limit, new connections are closed at once; the others are served")
    func connectionLimit() async throws {
        let fixture = try TestServer(configuration: VarlinkServerConfiguration(maximumConnections: 3))
        defer { Task { await fixture.stop() } }
        let clients = try (0..<3).map { _ in try fixture.client() }
        for client in clients { #expect(try client.call("io.example.Test.Echo", ["text": "x"]).parameters["text"] == "x") }
        let refused = try fixture.client()
        #expect(throws: VarlinkClientError.self) { try refused.call("io.example.Test.Echo", ["text": "x"]) }
        #expect(try clients[0].call("io.example.Test.Echo", ["text": "y"]).parameters["text"] == "y")
    }

    @Test("per uid: an ordinary peer's uid holds at most maximumConnectionsPerUser; a privileged peer is not counted and may take the reserved slots")
    func perUserLimit() async throws {
        // All test clients are this process's uid: privilege is switched per connection.
        let privileged = Atomic<Bool>(false)
        let events = Mutex<[VarlinkServerEvent.Refusal]>([])
        let fixture = try TestServer(configuration: VarlinkServerConfiguration(maximumConnections: 6, reservedConnections: 2,
                                                                              maximumConnectionsPerUser: 3,
                                                                              isPrivileged: { _ in privileged.load(ordering: .relaxed) }),
                                     onEvent: { if case let .connectionRefused(_, why) = $0 { events.withLock { $0.append(why) } } })
        defer { Task { await fixture.stop() } }
        let server = fixture.server
        func connect() throws -> VarlinkClient { try fixture.client(timeout: 5) }
        func served(_ client: VarlinkClient) -> Bool { (try? client.call("io.example.Test.Echo", ["text": "x"]))?.parameters["text"] == "x" }
        var ordinary = try (0..<3).map { _ in try connect() }
        #expect(ordinary.allSatisfy(served))
        #expect(!served(try connect()), "a fourth connection of the same uid was served")
        #expect(events.withLock { $0 } == [.userLimit])
        // Privileged peers: not counted per uid; they may fill the 3 remaining slots, the last 2
        // of which no ordinary peer may take.
        privileged.store(true, ordering: .relaxed)
        let admins = try (0..<3).map { _ in try connect() }
        #expect(admins.allSatisfy(served))
        #expect(!served(try connect()), "a seventh connection was served")
        #expect(events.withLock { $0 } == [.userLimit, .serverFull])
        // Closing an ordinary one frees its uid's slot, but not a reserved one: at 5 of 6 open,
        // an ordinary peer is refused (serverFull) while a privileged one is served.
        ordinary.removeFirst()   // closes it
        try await eventually("a slot freed") { server.connectionCount == 5 }
        privileged.store(false, ordering: .relaxed)
        #expect(!served(try connect()))
        #expect(events.withLock { $0.last } == .serverFull)
        privileged.store(true, ordering: .relaxed)
        #expect(served(try connect()))
    }

    @Test("a message started and not finished within messageTimeout closes its connection; the others are served meanwhile")
    func unfinishedMessage() async throws {
        let fixture = try TestServer(configuration: VarlinkServerConfiguration(messageTimeout: .milliseconds(300),
                                                                              protocolErrorName: "io.example.Test.ProtocolError"))
        defer { Task { await fixture.stop() } }
        let slow = try fixture.client(timeout: 10)
        try slow.send(Array(#"{"method":"io.example.Test.Echo","param"#.utf8))
        let started = ContinuousClock.now
        let other = try fixture.client()
        #expect(try other.call("io.example.Test.Echo", ["text": "meanwhile"]).parameters["text"] == "meanwhile")
        let reply = try slow.nextReply()
        #expect(reply.error == "io.example.Test.ProtocolError" && reply.parameters["reason"]?.stringValue?.hasPrefix("message not completed") == true)
        #expect(ContinuousClock.now - started >= .milliseconds(300))
        #expect(throws: VarlinkClientError.self) { try slow.nextReply() }
        // A client that keeps its messages whole is never timed out, however long it stays.
        let steady = try fixture.client()
        for _ in 0..<3 {
            try await Task.sleep(for: .milliseconds(200))   // idle time between whole messages is fine
            #expect(try steady.call("io.example.Test.Echo", ["text": "still here"]).parameters["text"] == "still here")
        }
    }

    @Test("the output budget for all clients together: flooders that do not read stop being read; a client that reads is served")
    func queuedOutputBudget() async throws {
        let fixture = try TestServer(configuration: VarlinkServerConfiguration(maximumPendingOutput: 64 << 20, maximumQueuedOutput: 64 << 10))
        defer { Task { await fixture.stop() } }
        let call = VarlinkCall(method: "io.example.Test.Echo", parameters: ["text": .string(String(repeating: "z", count: 1000))]).encoded()
        let batch = Array(repeating: call, count: 50).flatMap { $0 }
        var pushedBack = 0
        for _ in 0..<4 {
            let flooder = try fixture.client(timeout: 0.5)
            var sent = 0
            while sent < 20_000, (try? flooder.send(batch)) != nil { sent += 50 }
            if sent < 20_000 { pushedBack += 1 }
        }
        #expect(pushedBack == 4, "a flooder was read from without limit")
        let reader = try fixture.client()
        for _ in 0..<50 { #expect(try reader.call("io.example.Test.Echo", ["text": "served"]).parameters["text"] == "served") }
    }

    @Test("a client that sends and never reads does not stop the others")
    func neverReads() async throws {
        let fixture = try TestServer(configuration: VarlinkServerConfiguration(maximumPendingOutput: 64 << 10))
        defer { Task { await fixture.stop() } }
        let flooder = try fixture.client(timeout: 0.5)
        let call = VarlinkCall(method: "io.example.Test.Echo", parameters: ["text": .string(String(repeating: "z", count: 1000))]).encoded()
        let batch = Array(repeating: call, count: 100).flatMap { $0 }
        // Keep sending until the kernel buffers are full: the server has stopped reading.
        var sent = 0
        while sent < 20_000, (try? flooder.send(batch)) != nil { sent += 100 }
        #expect(sent < 20_000, "the server never pushed back")
        let other = try fixture.client()
        #expect(try other.call("io.example.Test.Echo", ["text": "served"]).parameters["text"] == "served")
    }

    @Test("a slow reader gets every reply once it reads: calls held back while its output was full go on")
    func slowReader() async throws {
        let fixture = try TestServer(configuration: VarlinkServerConfiguration(maximumPendingOutput: 16 << 10))
        defer { Task { await fixture.stop() } }
        let client = try fixture.client()
        let text = String(repeating: "y", count: 2000)
        let count = 400
        // 800 KB of replies, far beyond the 16 KB output limit and the socket buffers. The calls
        // go out from another task (on a duplicate descriptor) while this one reads.
        let batch = (0..<count).flatMap { _ in VarlinkCall(method: "io.example.Test.Echo", parameters: ["text": .string(text)]).encoded() }
        let writeFD = dup(client.fileDescriptor)
        let sender = Task.detached {
            defer { close(writeFD) }
            var offset = 0
            while offset < batch.count {
                let n = batch.withUnsafeBytes { send(writeFD, $0.baseAddress! + offset, batch.count - offset, Int32(MSG_NOSIGNAL)) }
                guard n > 0 else { throw POSIXError(.EIO) }
                offset += n
            }
        }
        for index in 0..<count {
            let reply = try client.nextReply()
            #expect(reply.parameters["text"]?.stringValue?.count == 2000, "reply \(index)")
        }
        try await sender.value
    }

    @Test("thousands of idle connections; everyone still served")
    func manyIdle() async throws {
        var limit = rlimit()
        getrlimit(Int32(RLIMIT_NOFILE.rawValue), &limit)
        limit.rlim_cur = limit.rlim_max
        setrlimit(Int32(RLIMIT_NOFILE.rawValue), &limit)
        let count = min(2000, Int(limit.rlim_cur / 2) - 100)
        let fixture = try TestServer()
        defer { Task { await fixture.stop() } }
        let idle = try (0..<count).map { _ in try fixture.client() }
        try await eventually("\(count) accepted") { fixture.server.connectionCount == count }
        let active = try fixture.client()
        #expect(try active.call("io.example.Test.Echo", ["text": "hello"]).parameters["text"] == "hello")
        #expect(try idle[count / 2].call("io.example.Test.Echo", ["text": "me too"]).parameters["text"] == "me too")
    }
}
