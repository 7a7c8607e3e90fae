#if canImport(Glibc)
import Glibc
#endif
import Basics
import BrokerContract
import Testing
@testable import TokenBrokerCLI
import Varlink
import WireJSON
import Foundation
import TokenBrokerCore

/// The one contract module against the interface text it ships: every method, error and
/// status field it encodes is declared there, and what one side encodes the other decodes.
@Suite struct ContractTests {
    let text = BrokerContract.text

    @Test func everyMethodIsDeclared() {
        #expect(Set(BrokerMethod.allCases.map(\.rawValue)) == BrokerContract.interface.methods)
    }

    @Test("a method's ordinal is its place among all methods; its member name decodes to it")
    func methodOrdinals() {
        #expect(BrokerMethod.allCases.map(\.ordinal) == Array(BrokerMethod.allCases.indices))
        for method in BrokerMethod.allCases { #expect(BrokerMethod(member: method.rawValue) == method) }
        #expect(BrokerMethod(member: "GetTokens") == nil && BrokerMethod(member: "getToken") == nil && BrokerMethod(member: "") == nil)
    }

    static let errors: [BrokerError] = [
        .noSuchSession(session: "a"), .signedOut(session: "a"), .signedOut(session: "a", login: "printf x | tokenbroker ctl login a --refresh-token-stdin"), .permissionDenied,
        .refreshFailed(session: "a", reason: "upstream said 503", retryable: true, retryAfter: 2.5),
        .refreshFailed(session: "a", reason: "invalid_grant", retryable: false, retryAfter: nil),
        .throttled(session: "a", retryAfter: 1), .lifetimeTooShort(session: "a", lifetime: 300, minValid: 600), .storeFailed(session: "a", reason: "disk full"),
        .configurationError(reason: "line 3"), .loginFailed(session: "a", reason: "denied"),
        .sessionConfigured(session: "a"), .shuttingDown, .internalError, .protocolError(reason: "not JSON"),
    ]

    @Test(arguments: errors)
    func errorsRoundTripAndAreDeclared(_ error: BrokerError) throws {
        let reply = error.reply
        let name = try #require(reply.error)
        #expect(name.hasPrefix(BrokerContract.name + "."))
        #expect(text.contains("\nerror \(name.dropFirst(BrokerContract.name.count + 1)) ("))
        #expect(BrokerError(reply) == error)
    }

    @Test("ctl exits as its help says: 69 stopping, 77 permission denied, 78 configuration error, else 1; no message quotes a token")
    func ctlExitCodes() {
        for error in Self.errors {
            let failure = Ctl.failure(error, .login(session: "a", refreshToken: "r-secret"))
            let expected: Int32
            switch error {
            case .shuttingDown: expected = ExitCode.unavailable
            case .permissionDenied: expected = ExitCode.permission
            case .configurationError: expected = ExitCode.config
            default: expected = ExitCode.failure
            }
            #expect(failure.code == expected, "\(error)")
            #expect(!failure.message.isEmpty && !failure.message.contains("r-secret"))
        }
    }

    @Test func foreignErrorsAreNotContractErrors() {
        #expect(BrokerError(VarlinkReply.error("org.example.Other", [:])) == nil)
        #expect(BrokerError(VarlinkReply(parameters: [:])) == nil)
        #expect(BrokerError(VarlinkReply.error(VarlinkServiceError.permissionDenied, [:])) == .permissionDenied)
    }

    static let requests: [BrokerRequest] = [
        .getToken(session: "a"), .recover(session: "a", rejected: "t"), .watch(session: "a"), .logout(session: "a"),
        .login(session: "a", refreshToken: "r"), .status, .reload, .refresh(session: "a"), .deviceLogin(session: "a"),
        .forget(session: "a"),
    ]

    @Test(arguments: requests)
    func requestsRoundTrip(_ request: BrokerRequest) throws {
        #expect(try BrokerRequest(request.method, request.parameters) == request)
        var extra = request.parameters
        extra["unexpected"] = 1
        #expect(throws: ParameterError.self) { try BrokerRequest(request.method, extra) }
    }

    @Test func missingOrEmptyParametersAreRefused() {
        #expect(throws: ParameterError.self) { try BrokerRequest(.getToken, [:]) }
        #expect(throws: ParameterError.self) { try BrokerRequest(.recover, ["session": "a"]) }
        #expect(throws: ParameterError.self) { try BrokerRequest(.login, ["session": "a", "refreshToken": ""]) }
        #expect(throws: ParameterError.self) { try BrokerRequest(.getToken, ["session": 1]) }
    }

    @Test func statusEntryRoundTripsAndMatchesTheDeclaredType() throws {
        var entry = StatusEntry(name: "api", state: "active", generation: 3)
        (entry.tokenSerial, entry.expiresAt, entry.lastRefresh) = (7, 1_800_000_000, 1_799_999_000)
        (entry.refreshing, entry.backoffRemaining, entry.lastError, entry.degraded) = (true, 1.5, "timeout", true)
        for (value, counter) in StatusEntry.Counter.allCases.enumerated() { entry.counters[counter] = value + 1 }
        entry.inert = true
        (entry.fleetHealth, entry.fleetGeneration, entry.fleetRevision, entry.flightHolder) = ("healthy", 4, 812, "host-b pid 7 1f")
        entry.throttledUsers = [1001, 4_000_000_000]
        entry.derivedFrom = "parent"
        entry.derivations = 3
        entry.keys = 2
        let parameters = entry.parameters
        #expect(StatusEntry(parameters) == entry)
        #expect(parameters["fetches"] == 1 && parameters["droppedResults"] == 6)
        let declared = try #require(text.range(of: "type SessionStatus (").flatMap { start in
            text[start.upperBound...].range(of: "\n)").map { text[start.upperBound..<$0.lowerBound] }
        })
        let fields = Set(declared.split(separator: "\n").compactMap { line -> String? in
            let line = line.drop { $0 == " " }
            guard !line.hasPrefix("#"), let colon = line.firstIndex(of: ":") else { return nil }
            return String(line[..<colon])
        })
        #expect(Set(parameters.keys) == fields)
        let reply = VarlinkReply(parameters: ["sessions": .array([.object(parameters), .object(StatusEntry(name: "b", state: "signedOut", generation: 0).parameters)])])
        #expect(StatusEntry.entries(of: reply).map(\.name) == ["api", "b"])
    }

    @Test func tokenAndWatchRepliesRoundTrip() {
        let token = TokenReply(token: "t", tokenType: "Bearer", expiresAt: 10, generation: 2)
        #expect(TokenReply(token.parameters) == token)
        for event in [WatchEvent.token(token, serial: 4), .signedOut(generation: 3)] {
            #expect(WatchEvent(event.parameters) == event)
        }
    }

    /// The output members the interface declares for `method`.
    func declaredOutput(_ method: String) throws -> Set<String> {
        let start = try #require(text.range(of: "method \(method)("))
        let arrow = try #require(text[start.upperBound...].range(of: ") -> ("))
        let end = try #require(text[arrow.upperBound...].range(of: "\n)"))
        return Set(text[arrow.upperBound..<end.lowerBound].split(separator: "\n").compactMap { line -> String? in
            let line = line.drop { $0 == " " }
            guard !line.hasPrefix("#"), let colon = line.firstIndex(of: ":") else { return nil }
            return String(line[..<colon])
        })
    }

    @Test("Login, Refresh, DeviceLogin and Metrics replies round-trip and send exactly the members the interface declares")
    func typedRepliesMatchTheInterface() throws {
        let (loginFields, refreshFields) = (try declaredOutput("Login"), try declaredOutput("Refresh"))
        let (deviceFields, metricsFields) = (try declaredOutput("DeviceLogin"), try declaredOutput("Metrics"))
        let login = LoginReply(generation: 4)
        #expect(LoginReply(login.parameters) == login && Set(login.parameters.keys) == loginFields)
        let refresh = RefreshReply(generation: 2, tokenSerial: 9, expiresAt: 1_800_000_000)
        #expect(RefreshReply(refresh.parameters) == refresh && Set(refresh.parameters.keys) == refreshFields)
        let prompt = DeviceLoginEvent.prompt(verificationUri: "https://as/device", userCode: "ABCD", expiresIn: 600,
                                             verificationUriComplete: "https://as/device?c=ABCD")
        let done = DeviceLoginEvent.done(LoginReply(generation: 5))
        #expect(DeviceLoginEvent(prompt.parameters) == prompt && DeviceLoginEvent(done.parameters) == done)
        #expect(Set(prompt.parameters.keys).union(done.parameters.keys) == deviceFields)
        let metrics = MetricsReply(text: "# HELP x\n")
        #expect(MetricsReply(metrics.parameters) == metrics && Set(metrics.parameters.keys) == metricsFields)
    }

    @Test("ctl's durations (--min-valid): seconds, s, m, h, d, combined; nothing outside 1 s to a year; minValid refused beside rejected and outside its range")
    func durations() throws {
        for (text, seconds) in [("90", 90), ("90s", 90), ("10m", 600), ("1h30m", 5400), ("2d", 172_800), ("1m1s", 61), ("365d", 31_536_000)] {
            #expect(Ctl.duration(text) == Int64(seconds), "\(text)")
        }
        for bad in ["", "0", "0s", "m", "10x", "-5", "1.5m", "366d", String(repeating: "9", count: 40), "10m ", "1h-1m"] {
            #expect(Ctl.duration(bad) == nil, "\(bad)")
        }
        #expect(try BrokerRequest(.getToken, ["session": "a", "minValid": 600]) == .getToken(session: "a", minValid: 600))
        for bad: JSON in [0, -1, 31_536_001, "600", 1.5, true] {
            #expect(throws: ParameterError.self) { try BrokerRequest(.getToken, ["session": "a", "minValid": bad]) }
        }
        #expect(throws: ParameterError.self) { try BrokerRequest(.credential, ["url": "https://h/", "rejected": "t", "minValid": 60]) }
        #expect(BrokerRequest.getToken(session: "a", minValid: 60).parameters == ["session": "a", "minValid": 60])
        #expect(BrokerRequest.getToken(session: "a").parameters == ["session": "a"])
    }

    @Test("GetToken and Recover take a key (resource, scope): bounded, a resource with a scheme and no fragment, scope words in one order; round-trips (issue 35)")
    func tokenKeys() throws {
        let key = TokenKey(resource: "https://r.example/", scope: "write read write")
        #expect(key?.scope == "read write")
        let request = try BrokerRequest(.getToken, ["session": "a", "resource": "https://r.example/", "scope": "write read"])
        #expect(request == .getToken(session: "a", key: key))
        #expect(try BrokerRequest(.getToken, request.parameters) == request)
        let recover = BrokerRequest.recover(session: "a", rejected: "t", key: TokenKey(resource: nil, scope: "read"))
        #expect(recover.parameters == ["session": "a", "rejected": "t", "scope": "read"])
        #expect(try BrokerRequest(.recover, recover.parameters) == recover)
        #expect(try BrokerRequest(.getToken, ["session": "a"]) == .getToken(session: "a"))
        let longest = "https://" + String(repeating: "a", count: 504)   // 512 bytes
        #expect(try BrokerRequest(.getToken, ["session": "a", "resource": .string(longest)]) == .getToken(session: "a", key: TokenKey(resource: longest, scope: nil)))
        #expect(try BrokerRequest(.getToken, ["session": "a", "scope": "  read   write "]) == .getToken(session: "a", key: TokenKey(resource: nil, scope: "read write")))
        for (name, bad): (String, JSON) in [("resource", "r.example"), ("resource", "https://r.example/#f"), ("resource", "https://r.example/ x"),
                                            ("resource", .string("https://" + String(repeating: "a", count: 600))), ("resource", 1),
                                            ("resource", .string("https://" + String(repeating: "a", count: 505))), ("resource", "a b://x"),
                                            ("scope", ""), ("scope", "   "), ("scope", "a\"b"), ("scope", .string(String(repeating: "s", count: 513))),
                                            ("scope", .string((0..<33).map { "w\($0)" }.joined(separator: " ")))] {
            #expect(throws: ParameterError(name: name)) { try BrokerRequest(.getToken, ["session": "a", name: bad]) }
        }
        // GetProof and Credential take the key too (round-trip), and refuse a bad one alike.
        for request in [BrokerRequest.getProof(session: "a", method: "GET", uri: "https://h/", nonce: nil, rejected: nil,
                                               key: TokenKey(resource: "https://r/", scope: "read")),
                        .credential(url: "https://h/", rejected: nil, key: TokenKey(resource: nil, scope: "read write"))] {
            #expect(try BrokerRequest(request.method, request.parameters) == request)
        }
        #expect(throws: ParameterError(name: "resource")) { try BrokerRequest(.getProof, ["session": "a", "method": "GET", "uri": "https://h/", "resource": "r/"]) }
        #expect(throws: ParameterError(name: "scope")) { try BrokerRequest(.credential, ["url": "https://h/", "scope": ""]) }
    }

    @Test("where a client finds the broker: $TOKENBROKER_SOCKET, else this user's own when one listens there, else the system's (issue 33)")
    func socketDiscovery() {
        let user = "/run/user/1000/tokenbroker/io.tokenbroker.Broker"
        func found(_ variables: [String: String], listening: Set<String>) -> String {
            BrokerContract.socket(variable: { variables[$0] }, listening: { listening.contains($0) })
        }
        #expect(found(["TOKENBROKER_SOCKET": "/srv/b.sock", "XDG_RUNTIME_DIR": "/run/user/1000"], listening: [user]) == "/srv/b.sock")
        #expect(found(["XDG_RUNTIME_DIR": "/run/user/1000"], listening: [user]) == user)
        #expect(found(["XDG_RUNTIME_DIR": "/run/user/1000"], listening: []) == BrokerContract.defaultSocket, "a stale file is nobody's broker")
        #expect(found(["XDG_RUNTIME_DIR": "relative", "TOKENBROKER_SOCKET": ""], listening: ["/run/user/\(getuid())/tokenbroker/io.tokenbroker.Broker"])
                == "/run/user/\(getuid())/tokenbroker/io.tokenbroker.Broker", "no absolute XDG_RUNTIME_DIR: /run/user/UID")
        let directories = UserDirectories(variable: { ["HOME": "/home/a", "XDG_STATE_HOME": "/srv/state"][$0] }, uid: 1000)
        #expect(directories == UserDirectories(variable: { ["XDG_RUNTIME_DIR": "/run/user/1000", "XDG_CONFIG_HOME": "/home/a/.config",
                                                             "XDG_STATE_HOME": "/srv/state"][$0] }, uid: 1000))
        #expect(directories.config == "/home/a/.config" && directories.state == "/srv/state" && directories.runtime == "/run/user/1000")
    }

    @Test("the errors a token call counts by are the contract's, by their names")
    func tokenCallErrorNames() {
        #expect(BrokerError.tokenCallErrors.map(\.name) == ["SignedOut", "RefreshFailed", "Throttled", "PermissionDenied", "NoSuchSession",
                                                             "StoreFailed", "ShuttingDown", "InternalError", "LifetimeTooShort"])
        for error in Self.errors { #expect(error.reply.error == BrokerContract.name + "." + error.name) }
    }

    @Test("every member of the interface that carries a credential is declared secret, and only those")
    func secretMembersAreTheCredentials() {
        // Every member name of the IDL, and those that name a token or a rejected one, or carry
        // an authorization code (a redirect URL) or a login's state (its authorization URL).
        let members = Set(text.split(separator: "\n").compactMap { line -> String? in
            let line = line.drop { $0 == " " }
            guard !line.hasPrefix("#"), let colon = line.firstIndex(of: ":"), !line.hasPrefix("method"), !line.hasPrefix("type") else { return nil }
            return String(line[..<colon])
        })
        let credentials = members.filter { name in
            let lower = name.lowercased()
            return lower.contains("token") && !lower.hasSuffix("type") && !lower.hasSuffix("serial") || lower == "rejected" || lower == "proof" || lower == "redirecturl" || lower == "authorizationuri"
        }
        #expect(credentials == BrokerContract.secretMembers)
        let call = VarlinkCall(method: "io.tokenbroker.Broker.Recover",
                               parameters: BrokerRequest.recover(session: "a", rejected: "hunter5").parameters)
        #expect(!"\(call)".contains("hunter5"))
        #expect(!"\(VarlinkReply(parameters: TokenReply(token: "hunter6", tokenType: "Bearer", expiresAt: nil, generation: 1).parameters))"
            .contains("hunter6"))
    }
}
