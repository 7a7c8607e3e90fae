import Synchronization
import Testing
import TokenBrokerCore
@testable import TokenBrokerDaemon
import Varlink

/// BrokerService called in memory: a real coordinator with the test upstream, peers made up.
@Suite("BrokerService")
struct BrokerServiceTests {
    static let admin = PeerCredentials(pid: 1, uid: 0, gid: 0)
    static let worker = PeerCredentials(pid: 2, uid: 1000, gid: 1000, groups: [2000])
    static let stranger = PeerCredentials(pid: 3, uid: 1001, gid: 1001)

    static func service() async -> BrokerService {
        let table = SessionTable(access: Access(daemonUID: 0, adminGroup: 3000))
        let configuration = SessionConfiguration(name: "api", upstream: .test(lifetime: .seconds(3600)), allowUsers: [],
                                                 allowGroups: [2000], policy: RefreshPolicy(), origin: "test")
        let coordinator = Coordinator(session: "api", source: TestTokenSource(lifetime: .seconds(3600)), store: InMemorySessionStore(),
                                      clock: ContinuousClock(), wall: SystemWallClock())
        _ = try? await coordinator.login(refreshToken: nil)
        // "private": for admins only.
        let privateConfiguration = SessionConfiguration(name: "private", upstream: .test(lifetime: .seconds(3600)), allowUsers: [],
                                                        allowGroups: [], policy: RefreshPolicy(), origin: "test")
        let privateCoordinator = Coordinator(session: "private", source: TestTokenSource(lifetime: .seconds(3600)),
                                             store: InMemorySessionStore(), clock: ContinuousClock(), wall: SystemWallClock())
        let census = SessionCensus()
        table.replace(SessionTable.Snapshot(sessions: ["api": .init(configuration: configuration, coordinator: coordinator, slot: census.enrol("api")),
                                                       "private": .init(configuration: privateConfiguration, coordinator: privateCoordinator,
                                                                        slot: census.enrol("private"))],
                                            order: ["api", "private"], access: Access(daemonUID: 0, adminGroup: 3000)))
        return BrokerService(sessions: table, logger: Logger(level: .emergency), reload: { nil })
    }

    /// Runs a call to completion and returns its replies.
    static func call(_ service: BrokerService, _ method: String, _ parameters: JSONObject = [:], more: Bool = false,
                     from peer: PeerCredentials = admin) async -> [VarlinkReply] {
        // Each reply as a client reads it: encoded, then decoded.
        @Sendable func wire(_ reply: VarlinkReply) -> VarlinkReply {
            (try? VarlinkReply.decode(reply.encoded().dropLast())) ?? VarlinkReply.error("undecodable")
        }
        switch service.handle(VarlinkCall(method: "io.tokenbroker.Broker." + method, parameters: parameters, more: more), from: peer) {
        case let .reply(reply):
            return [wire(reply)]
        case let .async(body):
            let replies = Mutex<[VarlinkReply]>([])
            await body(VarlinkReplySink { reply in if let reply { replies.withLock { $0.append(wire(reply)) } } })
            return replies.withLock { $0 }
        }
    }

    @Test("GetToken: waits for the first fetch, then answers inline from the snapshot")
    func getToken() async throws {
        let service = await Self.service()
        guard case .async = service.handle(VarlinkCall(method: "io.tokenbroker.Broker.GetToken", parameters: ["session": "api"]), from: Self.worker) else {
            Issue.record("the first GetToken should wait for a fetch")
            return
        }
        let first = await Self.call(service, "GetToken", ["session": "api"], from: Self.worker)
        #expect(first.first?.error == nil && first.first?.parameters["tokenType"] == "Bearer" && first.first?.parameters["generation"] == 1)
        guard case let .reply(inline) = service.handle(VarlinkCall(method: "io.tokenbroker.Broker.GetToken", parameters: ["session": "api"]),
                                                       from: Self.worker) else {
            Issue.record("a fresh token should be answered inline")
            return
        }
        #expect(inline.parameters["token"] != nil && inline.parameters["expiresAt"]?.intValue != nil)
    }

    @Test("GetToken inline: the reply encoded once per token is byte for byte the plain encoding; after a refresh or a logout no caller gets the old one")
    func cachedReply() async throws {
        // Expectations on Bools only: a failure must not print a token.
        let service = await Self.service()
        _ = await Self.call(service, "GetToken", ["session": "api"], from: Self.worker)
        func inline() -> VarlinkReply? {
            guard case let .reply(reply) = service.handle(VarlinkCall(method: "io.tokenbroker.Broker.GetToken", parameters: ["session": "api"]),
                                                          from: Self.worker) else { return nil }
            return reply
        }
        let first = try #require(inline())
        let firstEncodedAsPlain = first.encoded() == VarlinkReply(parameters: first.parameters).encoded()
        #expect(firstEncodedAsPlain)
        let sameAgain = try #require(inline()).encoded() == first.encoded()
        #expect(sameAgain)

        #expect(await Self.call(service, "Refresh", ["session": "api"]).first?.error == nil)
        let second = try #require(inline())
        let changed = second.parameters["token"] != first.parameters["token"] && second.encoded() != first.encoded()
        #expect(changed, "a refresh must change the inline answer")
        let secondEncodedAsPlain = second.encoded() == VarlinkReply(parameters: second.parameters).encoded()
        #expect(secondEncodedAsPlain)

        #expect(await Self.call(service, "Logout", ["session": "api"]).first?.error == nil)
        let after = await Self.call(service, "GetToken", ["session": "api"], from: Self.worker)
        #expect(after.map(\.error) == ["io.tokenbroker.Broker.SignedOut"], "\(after.map(\.error))")
    }

    @Test("contract errors: NoSuchSession, PermissionDenied, InvalidParameter, SignedOut")
    func errors() async {
        let service = await Self.service()
        #expect(await Self.call(service, "GetToken", ["session": "nope"]) == [.error("io.tokenbroker.Broker.NoSuchSession", ["session": "nope"])])
        #expect(await Self.call(service, "GetToken", ["session": "api"], from: Self.stranger) == [.error("io.tokenbroker.Broker.PermissionDenied")])
        // Session names cannot be probed: to a peer that may not use it, a session that does
        // not exist looks exactly like one that does (every method that names a session).
        for (method, parameters) in [("GetToken", [:]), ("Recover", ["rejected": "x"]), ("Watch", [:])] as [(String, JSONObject)] {
            for peer in [Self.stranger, Self.worker] {
                var existing = parameters, missing = parameters
                existing["session"] = peer == Self.worker ? "private" : "api"
                missing["session"] = "nope"
                let answers = [await Self.call(service, method, existing, more: method == "Watch", from: peer),
                               await Self.call(service, method, missing, more: method == "Watch", from: peer)]
                #expect(answers[0] == answers[1] && answers[0] == [.error("io.tokenbroker.Broker.PermissionDenied")], "\(method): \(answers)")
            }
        }
        // Who may call is checked before the rest of the parameters: a caller who may not use
        // the session learns nothing from them, and an admin naming no session hears that first.
        #expect(await Self.call(service, "Recover", ["session": "private"], from: Self.worker) == [.error("io.tokenbroker.Broker.PermissionDenied")])
        #expect(await Self.call(service, "Recover", ["session": "nope", "extra": 1], from: Self.stranger) == [.error("io.tokenbroker.Broker.PermissionDenied")])
        #expect(await Self.call(service, "Login", ["session": "api", "refreshToken": ""], from: Self.worker) == [.error("io.tokenbroker.Broker.PermissionDenied")])
        #expect(await Self.call(service, "Recover", ["session": "nope"]) == [.error("io.tokenbroker.Broker.NoSuchSession", ["session": "nope"])])
        #expect(await Self.call(service, "Login", ["session": "nope", "refreshToken": ""]) == [.error("io.tokenbroker.Broker.NoSuchSession", ["session": "nope"])])
        #expect(await Self.call(service, "GetToken", [:]) == [.invalidParameter("session")])
        #expect(await Self.call(service, "GetToken", ["session": 3]) == [.invalidParameter("session")])
        #expect(await Self.call(service, "Recover", ["session": "api"]) == [.invalidParameter("rejected")])
        #expect(await Self.call(service, "Status", ["all": true]) == [.invalidParameter("all")])
        #expect(await Self.call(service, "Logout", ["session": "api"], from: Self.worker) == [.error("io.tokenbroker.Broker.PermissionDenied")])
        #expect(await Self.call(service, "Reload", from: Self.worker) == [.error("io.tokenbroker.Broker.PermissionDenied")])
        #expect(await Self.call(service, "Login", ["session": "api", "refreshToken": ""]) == [.invalidParameter("refreshToken")])
        #expect(await Self.call(service, "Watch", ["session": "api"]) == [.error("org.varlink.service.ExpectedMore")])

        #expect(await Self.call(service, "Logout", ["session": "api"]) == [VarlinkReply()])
        #expect(await Self.call(service, "GetToken", ["session": "api"], from: Self.worker) == [.error("io.tokenbroker.Broker.SignedOut", ["session": "api", "login": "printf x | tokenbroker ctl login api --refresh-token-stdin"])])
        let login = await Self.call(service, "Login", ["session": "api", "refreshToken": "r-1"])
        #expect(login == [VarlinkReply(parameters: ["generation": 3])])
    }

    @Test("Recover with a stale token returns the current one; Status hides sessions from strangers")
    func recoverAndStatus() async throws {
        let service = await Self.service()
        let first = try #require(await Self.call(service, "GetToken", ["session": "api"]).first?.parameters["token"])
        let stale = await Self.call(service, "Recover", ["session": "api", "rejected": "not-the-current-one"], from: Self.worker)
        #expect(stale.first?.parameters["token"] == first)
        let status = await Self.call(service, "Status", from: Self.worker)
        let entry = try #require(status.first?.parameters["sessions"]?.arrayValue?.first?.objectValue)
        #expect(entry["name"] == "api" && entry["staleRejections"] == 1 && entry["fetches"] == 1 && entry["state"] == "active")
        #expect(!JSON.object(entry).text.contains(first.stringValue!))
        #expect(await Self.call(service, "Status", from: Self.stranger) == [VarlinkReply(parameters: ["sessions": []])])
        // Entries are encoded once per change of their session: each change shows at the next Status.
        _ = await Self.call(service, "Recover", ["session": "api", "rejected": "not-the-current-one"], from: Self.worker)
        let again = await Self.call(service, "Status", from: Self.worker)
        #expect(again.first?.parameters["sessions"]?.arrayValue?.first?.objectValue?["staleRejections"] == 2)
        _ = await Self.call(service, "Logout", ["session": "api"])
        let out = await Self.call(service, "Status", from: Self.worker)
        #expect(out.first?.parameters["sessions"]?.arrayValue?.first?.objectValue?["state"] == "signedOut")
    }

    @Test("Watch: the current token at once, then signedOut as the final reply")
    func watch() async throws {
        let service = await Self.service()
        let replies = Mutex<[VarlinkReply]>([])
        guard case let .async(body) = service.handle(VarlinkCall(method: "io.tokenbroker.Broker.Watch", parameters: ["session": "api"], more: true),
                                                     from: Self.worker) else { return }
        let watcher = Task { await body(VarlinkReplySink { reply in if let reply { replies.withLock { $0.append(reply) } } }) }
        let deadline = ContinuousClock.now + .seconds(20)
        while replies.withLock({ $0.count }) < 1 && ContinuousClock.now < deadline { await Task.yield() }
        _ = await Self.call(service, "Logout", ["session": "api"])
        await watcher.value
        let events = replies.withLock { $0 }
        #expect(events.map { $0.parameters["event"] } == ["token", "signedOut"])
        #expect(events.map(\.continues) == [true, false])
        #expect(events[0].parameters["tokenSerial"] == 1 && events[1].parameters["generation"] == 2)
    }

    @Test("every SessionError maps to its contract error, with no secret")
    func mapping() async {
        let service = await Self.service()
        #expect(service.reply(for: SessionError.throttled(retryAfter: .seconds(3)), session: "api")
                == .error("io.tokenbroker.Broker.Throttled", ["session": "api", "retryAfter": 3.0]))
        #expect(service.reply(for: SessionError.refreshFailed(reason: "invalid_grant", retryable: false, retryAfter: nil), session: "api")
                == .error("io.tokenbroker.Broker.RefreshFailed", ["session": "api", "reason": "invalid_grant", "retryable": false]))
        #expect(service.reply(for: SessionError.refreshFailed(reason: "HTTP 503", retryable: true, retryAfter: .seconds(2)), session: "api")
                == .error("io.tokenbroker.Broker.RefreshFailed", ["session": "api", "reason": "HTTP 503", "retryable": true, "retryAfter": 2.0]))
        #expect(service.reply(for: SessionError.storeFailed(reason: "disk full"), session: "api")
                == .error("io.tokenbroker.Broker.StoreFailed", ["session": "api", "reason": "disk full"]))
        #expect(service.reply(for: SessionError.shuttingDown, session: "api") == .error("io.tokenbroker.Broker.ShuttingDown"))
        struct Unexpected: Error { let secret = "hunter2" }
        #expect(service.reply(for: Unexpected(), session: "api") == .error("io.tokenbroker.Broker.InternalError"))
    }

    @Test("access: root, the daemon's user and the admin group administer; allow-lists use")
    func access() {
        let access = Access(daemonUID: 500, adminGroup: 3000)
        let session = SessionConfiguration(name: "s", upstream: .test(lifetime: .seconds(1)), allowUsers: [1000], allowGroups: [2000],
                                           policy: RefreshPolicy(), origin: "t")
        #expect(access.isAdmin(PeerCredentials(pid: 1, uid: 0, gid: 5)))
        #expect(access.isAdmin(PeerCredentials(pid: 1, uid: 500, gid: 5)))
        #expect(access.isAdmin(PeerCredentials(pid: 1, uid: 7, gid: 5, groups: [3000])))
        #expect(!access.isAdmin(PeerCredentials(pid: 1, uid: 1000, gid: 2000)))
        #expect(access.mayUse(session, PeerCredentials(pid: 1, uid: 1000, gid: 1)))
        #expect(access.mayUse(session, PeerCredentials(pid: 1, uid: 9, gid: 2000)))
        #expect(access.mayUse(session, PeerCredentials(pid: 1, uid: 9, gid: 9, groups: [1, 2000])))
        #expect(!access.mayUse(session, PeerCredentials(pid: 1, uid: 9, gid: 9, groups: [1])))
    }

    @Test("access: the overflow ids (an unmapped peer) match no allow list, no admin group, not even a daemon running as nobody")
    func overflowIDs() {
        let overflow = PeerCredentials(pid: 1, uid: 65534, gid: 65534, groups: [65534])
        let session = SessionConfiguration(name: "s", upstream: .test(lifetime: .seconds(1)), allowUsers: [65534], allowGroups: [65534],
                                           policy: RefreshPolicy(), origin: "t")
        let access = Access(daemonUID: 65534, adminGroup: 65534, overflowUID: 65534, overflowGID: 65534)
        #expect(!access.isAdmin(overflow))
        #expect(!access.mayUse(session, overflow))
        // An unmapped uid with a real supplementary group still counts as that group's member;
        // a mapped uid in the overflow group does not.
        let grouped = SessionConfiguration(name: "g", upstream: .test(lifetime: .seconds(1)), allowUsers: [], allowGroups: [2000],
                                           policy: RefreshPolicy(), origin: "t")
        #expect(access.mayUse(grouped, PeerCredentials(pid: 1, uid: 65534, gid: 65534, groups: [2000])))
        #expect(!access.mayUse(session, PeerCredentials(pid: 1, uid: 1000, gid: 65534)))
        // Root is still root.
        #expect(access.isAdmin(PeerCredentials(pid: 1, uid: 0, gid: 0)))
    }

    @Test("user namespaces: configured ids outside the uid/gid map are named; inside it (any container that maps them), nothing")
    func unmappedIDs() throws {
        var configuration = BrokerConfiguration()
        configuration.adminGroup = 3000
        configuration.sessions = [SessionConfiguration(name: "s", upstream: .test(lifetime: .seconds(1)), allowUsers: [1000, 0, 1000],
                                                       allowGroups: [2000], policy: RefreshPolicy(), origin: "t")]
        let identity = try #require(ProcessDefences.IDMap("         0          0 4294967295\n"))
        #expect(ProcessDefences.unmappedIDWarnings(configuration, uidMap: identity, gidMap: identity).isEmpty)
        // An unprivileged container: 0-65535 inside map to 100000-165535 outside. All mapped.
        let container = try #require(ProcessDefences.IDMap("         0     100000      65536\n"))
        #expect(ProcessDefences.unmappedIDWarnings(configuration, uidMap: container, gidMap: container).isEmpty)
        // PrivateUsers=yes: only root and the daemon's own user (here 995).
        let privateUsers = try #require(ProcessDefences.IDMap("0 0 1\n995 995 1\n"))
        let warnings = ProcessDefences.unmappedIDWarnings(configuration, uidMap: privateUsers, gidMap: privateUsers)
        #expect(warnings.count == 3, "\(warnings)")
        #expect(warnings.first?.hasPrefix("uid 1000 has no mapping") == true && warnings.dropFirst().first?.hasPrefix("gid 2000") == true)
        #expect(warnings.last?.hasPrefix("gid 3000") == true)
        #expect(ProcessDefences.IDMap("0 0\n") == nil && ProcessDefences.IDMap("") == ProcessDefences.IDMap("\n"))
        #expect(!(try #require(ProcessDefences.IDMap("4294967295 0 1\n"))).contains(0))
    }
}
