#if canImport(Glibc)
import Glibc
#endif
import Basics
import Varlink

/// The `io.tokenbroker.Broker` interface as both sides speak it: the daemon's service, `ctl`
/// and the client library all use these names, requests, replies and errors, so the wire
/// contract is written once (the interface text next to this file is the human-readable
/// version, served byte for byte by `GetInterfaceDescription`).
public enum BrokerContract {
    public static let name = "io.tokenbroker.Broker"
    /// The text of `io.tokenbroker.Broker.varlink`, embedded at build time.
    public static let text = String(decoding: PackageResources.io_tokenbroker_Broker_varlink, as: UTF8.self)
    public static let interface = VarlinkInterface(description: text, secretMembers: secretMembers)
    /// The members whose values are credentials (a token, a refresh token, a rejected token, a
    /// redirect that carries an authorization code, an authorization URL whose state a code
    /// injected into the login would need):
    /// descriptions of calls and replies never show them (`VarlinkRedaction`).
    public static let secretMembers = Set(secretMemberNames)
    static let secretMemberNames = ["token", "refreshToken", "rejected", "proof", "redirectUrl", "authorizationUri"]
    /// Registers `secretMembers` once, at the first request a client or the daemon makes or reads
    /// (as a list: a client's first call builds no set).
    static let secretsRegistered: Void = VarlinkRedaction.register(secretMemberNames)
    /// Where the broker listens unless configured otherwise (`Socket=`, `$TOKENBROKER_SOCKET`).
    public static let defaultSocket = "/run/tokenbroker/io.tokenbroker.Broker"

    /// A user's own broker's socket (`tokenbroker serve --user`, the user units):
    /// `$XDG_RUNTIME_DIR/tokenbroker/io.tokenbroker.Broker`.
    public static func userSocket(_ directories: UserDirectories = UserDirectories()) -> String {
        directories.runtime + "/tokenbroker/io.tokenbroker.Broker"
    }

    /// The broker a client talks to when it names none: `$TOKENBROKER_SOCKET` if set, else the
    /// user's own broker if something listens on its socket (systemd leaves a stopped socket
    /// unit's file behind), else the system's (`--socket`, where a command takes it, comes
    /// before all of these).
    public static func socket(variable: (String) -> String? = { getenv($0).map { String(cString: $0) } },
                              listening: (String) -> Bool = isListening) -> String {
        if let named = variable("TOKENBROKER_SOCKET"), !named.isEmpty { return named }
        let user = userSocket(UserDirectories(variable: variable))
        return listening(user) ? user : defaultSocket
    }

    /// Whether something listens on the socket file at `path` (a file that is no socket, a
    /// symlink, or none: no; the connection is closed at once, never waited on).
    public static func isListening(_ path: String) -> Bool {
        var info = stat()
        return lstat(path, &info) == 0 && info.st_mode & S_IFMT == S_IFSOCK && UnixSocket.isListening(path)
    }
}

/// The interface's methods.
public enum BrokerMethod: String, Sendable, CaseIterable {
    case getToken = "GetToken", recover = "Recover", watch = "Watch", logout = "Logout", login = "Login"
    case status = "Status", reload = "Reload", refresh = "Refresh", deviceLogin = "DeviceLogin", forget = "Forget"
    case metrics = "Metrics", credential = "Credential", getProof = "GetProof"
    case codeLogin = "CodeLogin", completeCodeLogin = "CompleteCodeLogin", loginFlow = "LoginFlow"
    case resetFleetHistory = "ResetFleetHistory"
    case delegate = "Delegate", delegations = "Delegations", undelegate = "Undelegate"
    case audit = "Audit"
    case clientKey = "ClientKey"

    /// `io.tokenbroker.Broker.<Method>`.
    public var qualifiedName: String { BrokerContract.name + "." + rawValue }

    /// The method's place in `allCases`: an index into a table of methods (a dictionary keyed
    /// by the method hashed its name on every call).
    public var ordinal: Int {
        switch self {
        case .getToken: 0
        case .recover: 1
        case .watch: 2
        case .logout: 3
        case .login: 4
        case .status: 5
        case .reload: 6
        case .refresh: 7
        case .deviceLogin: 8
        case .forget: 9
        case .metrics: 10
        case .credential: 11
        case .getProof: 12
        case .codeLogin: 13
        case .completeCodeLogin: 14
        case .loginFlow: 15
        case .resetFleetHistory: 16
        case .delegate: 17
        case .delegations: 18
        case .undelegate: 19
        case .audit: 20
        case .clientKey: 21
        }
    }

    /// The method a call's member names. The hot ones are compared first: `init(rawValue:)`
    /// hashes the name into a table on every call, ten times the cost of comparing it.
    public init?(member: String) {
        switch member.utf8.count {
        case 8 where member == "GetToken": self = .getToken
        case 8 where member == "GetProof": self = .getProof
        case 7 where member == "Recover": self = .recover
        default: self.init(rawValue: member)
        }
    }

    /// Whether it is called with `more` (its replies stream). (A switch: a list of methods
    /// made on every call was a part of a `ctl` call's start.)
    public var streams: Bool {
        switch self {
        case .watch, .deviceLogin, .codeLogin: true
        default: false
        }
    }
}

/// What a call narrows a session's token to (`resource`, `scope`): a key with its own token
/// and flight, within what the session allows (`AllowResources=`, `AllowScopes=`).
public struct TokenKey: Sendable, Hashable {
    /// An RFC 8707 resource indicator: an absolute URL without a fragment.
    public var resource: String?
    /// Scope words, each once, in order (the same key however they were written).
    public var scope: String?

    public init?(resource: String?, scope: String?) {
        guard resource != nil || scope != nil else { return nil }
        self.resource = resource
        self.scope = scope.map(Self.normalized)
    }

    /// Scope words each once, in order (a one-word scope as it is: the common case costs nothing).
    static func normalized(_ scope: String) -> String {
        guard scope.contains(" ") else { return scope }
        return Array(Set(scope.split(separator: " ").map(String.init))).sorted().joined(separator: " ")
    }

    /// Whether `text` is a resource a call may name (and `AllowResources=` may list): 1 to 512
    /// bytes of visible ASCII, `scheme://…`, no fragment.
    public static func isResource(_ text: String) -> Bool {
        // Bytes, not characters: this runs on every call that names a key.
        let bytes = text.utf8
        guard (1...512).contains(bytes.count), bytes.allSatisfy({ $0 > 0x20 && $0 < 0x7F && $0 != UInt8(ascii: "#") }),
              let colon = bytes.firstIndex(of: UInt8(ascii: ":")), colon > bytes.startIndex,
              bytes[colon...].starts(with: "://".utf8) else { return false }
        return bytes[..<colon].allSatisfy { byte in
            (0x41...0x5A).contains(byte) || (0x61...0x7A).contains(byte) || (0x30...0x39).contains(byte)
                || byte == UInt8(ascii: "+") || byte == UInt8(ascii: "-") || byte == UInt8(ascii: ".")
        }
    }

    /// The scope's words.
    public var scopeWords: [Substring] { (scope ?? "").split(separator: " ") }

    /// Reads `resource` and `scope` from a call's parameters: bounded, visible ASCII; a resource
    /// with a scheme and no fragment, a scope of at most 32 words.
    static func read(_ parameters: Parameters) throws(ParameterError) -> TokenKey? {
        let resource = try parameters.optionalString("resource")
        if let resource, !isResource(resource) { throw ParameterError(name: "resource") }
        let scope = try parameters.optionalString("scope")
        if let scope {
            let words = scope.split(separator: " ")
            guard (1...512).contains(scope.utf8.count), (1...32).contains(words.count),
                  scope.utf8.allSatisfy({ $0 >= 0x20 && $0 < 0x7F && $0 != UInt8(ascii: "\"") && $0 != UInt8(ascii: "\\") }) else {
                throw ParameterError(name: "scope")
            }
        }
        return TokenKey(resource: resource, scope: scope)
    }

    var parameters: JSONObject {
        var parameters: JSONObject = [:]
        if let resource { parameters["resource"] = .string(resource) }
        if let scope { parameters["scope"] = .string(scope) }
        return parameters
    }
}

/// A call, decoded once from its parameters (unknown parameters are refused).
public enum BrokerRequest: Sendable, Equatable {
    /// With `minValid` (seconds), a token that stays valid that long (`LifetimeTooShort` if none
    /// can); with `key`, the session's token narrowed to it.
    case getToken(session: String, minValid: Int64? = nil, key: TokenKey? = nil)
    case recover(session: String, rejected: String, key: TokenKey? = nil)
    case watch(session: String)
    case logout(session: String)
    case login(session: String, refreshToken: String)
    case status
    case reload
    case refresh(session: String)
    case deviceLogin(session: String)
    case forget(session: String)
    case metrics
    /// The token for `url`, for credential helpers; with `rejected`, as Recover answers.
    case credential(url: String, rejected: String?, minValid: Int64? = nil, key: TokenKey? = nil)
    /// The token with a DPoP proof for one request; with `rejected`, as Recover answers.
    indirect case getProof(session: String, method: String, uri: String, nonce: String?, rejected: String?, minValid: Int64? = nil, key: TokenKey? = nil)
    /// An authorization code login (PKCE), waiting for the browser's redirect at the daemon's
    /// listener; with `refusals`, each request the listener refuses is told (`refused` events).
    case codeLogin(session: String, refusals: Bool = false)
    /// The redirect that ends a code login, pasted (the browser was on another host).
    case completeCodeLogin(session: String, redirectUrl: String)
    /// Which interactive login `ctl login` uses for the session.
    case loginFlow(session: String)
    /// Starts a fleet session's history anew (an admin's way out of a generation at its limit).
    case resetFleetHistory(session: String)
    /// Chosen sessions on a socket of their own (an admin's); the delegations; the end of one.
    indirect case delegate(DelegationRequest)
    case delegations
    case undelegate(name: String)
    /// The newest audit records (an admin's), of one session when named.
    case audit(session: String?, limit: Int?)
    /// A `private_key_jwt` session's client keys (an admin's), after `change`.
    case clientKey(session: String, change: ClientKeyChange)

    public var method: BrokerMethod {
        switch self {
        case .getToken: return .getToken
        case .recover: return .recover
        case .watch: return .watch
        case .logout: return .logout
        case .login: return .login
        case .status: return .status
        case .reload: return .reload
        case .refresh: return .refresh
        case .deviceLogin: return .deviceLogin
        case .forget: return .forget
        case .metrics: return .metrics
        case .credential: return .credential
        case .getProof: return .getProof
        case .codeLogin: return .codeLogin
        case .completeCodeLogin: return .completeCodeLogin
        case .loginFlow: return .loginFlow
        case .resetFleetHistory: return .resetFleetHistory
        case .delegate: return .delegate
        case .delegations: return .delegations
        case .undelegate: return .undelegate
        case .audit: return .audit
        case .clientKey: return .clientKey
        }
    }

    /// The session the call names, if any.
    public var session: String? {
        switch self {
        case let .getToken(session, _, _), let .recover(session, _, _), let .watch(session), let .logout(session), let .login(session, _),
             let .refresh(session), let .deviceLogin(session), let .forget(session), let .getProof(session, _, _, _, _, _, _),
             let .codeLogin(session, _), let .completeCodeLogin(session, _), let .loginFlow(session), let .resetFleetHistory(session),
             let .clientKey(session, _):
            return session
        case .status, .reload, .metrics, .credential, .delegate, .delegations, .undelegate, .audit:
            return nil
        }
    }

    /// Decodes `method`'s parameters.
    public init(_ method: BrokerMethod, _ object: JSONObject) throws(ParameterError) {
        BrokerContract.secretsRegistered
        let parameters = Parameters(object)
        func session(_ others: [String] = []) throws(ParameterError) -> String {
            try parameters.only("session", others)
            return try parameters.string("session")
        }
        switch method {
        case .getToken:
            self = .getToken(session: try session(["minValid", "resource", "scope"]), minValid: try Self.minValid(of: parameters),
                             key: try TokenKey.read(parameters))
        case .recover:
            self = .recover(session: try session(["rejected", "resource", "scope"]), rejected: try parameters.string("rejected"),
                            key: try TokenKey.read(parameters))
        case .watch: self = .watch(session: try session())
        case .logout: self = .logout(session: try session())
        case .login:
            let name = try session(["refreshToken"])
            let refreshToken = try parameters.string("refreshToken")
            guard !refreshToken.isEmpty else { throw ParameterError(name: "refreshToken") }
            self = .login(session: name, refreshToken: refreshToken)
        case .status:
            try parameters.only([])
            self = .status
        case .reload:
            try parameters.only([])
            self = .reload
        case .refresh: self = .refresh(session: try session())
        case .deviceLogin: self = .deviceLogin(session: try session())
        case .forget: self = .forget(session: try session())
        case .metrics:
            try parameters.only([])
            self = .metrics
        case .credential:
            try parameters.only(["url", "rejected", "minValid", "resource", "scope"])
            let url = try parameters.string("url")
            guard !url.isEmpty, url.utf8.count <= 2048 else { throw ParameterError(name: "url") }
            let rejected = try parameters.optionalString("rejected")
            if let rejected, rejected.isEmpty { throw ParameterError(name: "rejected") }
            self = .credential(url: url, rejected: rejected, minValid: try Self.minValid(of: parameters, rejected: rejected),
                               key: try TokenKey.read(parameters))
        case .getProof:
            let name = try session(["method", "uri", "nonce", "rejected", "minValid", "resource", "scope"])
            let method = try parameters.string("method")
            guard (1...16).contains(method.utf8.count), method.utf8.allSatisfy({ (0x41...0x5A).contains($0) }) else {
                throw ParameterError(name: "method")
            }
            let uri = try parameters.string("uri")
            let lower = uri.prefix(8).lowercased()
            guard uri.utf8.count <= 4096, lower.hasPrefix("https://") || lower.hasPrefix("http://"),
                  uri.utf8.allSatisfy({ $0 > 0x20 && $0 < 0x7F }) else { throw ParameterError(name: "uri") }
            // A nonce is the server's token68-like value (RFC 9449 §8.1: NQCHAR), bounded.
            let nonce = try parameters.optionalString("nonce")
            if let nonce, nonce.isEmpty || nonce.utf8.count > 512
                || !nonce.utf8.allSatisfy({ $0 >= 0x21 && $0 <= 0x7E && $0 != UInt8(ascii: "\"") && $0 != UInt8(ascii: "\\") }) {
                throw ParameterError(name: "nonce")
            }
            let rejected = try parameters.optionalString("rejected")
            if let rejected, rejected.isEmpty { throw ParameterError(name: "rejected") }
            self = .getProof(session: name, method: method, uri: uri, nonce: nonce, rejected: rejected,
                             minValid: try Self.minValid(of: parameters, rejected: rejected), key: try TokenKey.read(parameters))
        case .codeLogin:
            let name = try session(["refusals"])
            self = .codeLogin(session: name, refusals: try parameters.optionalBool("refusals") ?? false)
        case .completeCodeLogin:
            let name = try session(["redirectUrl"])
            let redirect = try parameters.string("redirectUrl")
            guard !redirect.isEmpty, redirect.utf8.count <= 8192 else { throw ParameterError(name: "redirectUrl") }
            self = .completeCodeLogin(session: name, redirectUrl: redirect)
        case .loginFlow: self = .loginFlow(session: try session())
        case .resetFleetHistory: self = .resetFleetHistory(session: try session())
        case .delegate: self = .delegate(try DelegationRequest(parameters))
        case .delegations:
            try parameters.only([])
            self = .delegations
        case .undelegate:
            try parameters.only(["name"])
            let name = try parameters.string("name")
            guard BrokerContract.isName(name) else { throw ParameterError(name: "name") }
            self = .undelegate(name: name)
        case .audit:
            try parameters.only(["session", "limit"])
            let session = try parameters.optionalString("session")
            if let session, !BrokerContract.isName(session) { throw ParameterError(name: "session") }
            var limit: Int?
            switch parameters.object["limit"] {
            case nil, .null?: break
            case let value?:
                guard let number = value.intValue, (1...Int64(AuditEntry.mostListed)).contains(number) else { throw ParameterError(name: "limit") }
                limit = Int(number)
            }
            self = .audit(session: session, limit: limit)
        case .clientKey:
            let name = try session(["change"])
            let change = try parameters.optionalString("change").map { text throws(ParameterError) -> ClientKeyChange in
                guard let change = ClientKeyChange(rawValue: text) else { throw ParameterError(name: "change") }
                return change
            }
            self = .clientKey(session: name, change: change ?? .show)
        }
    }

    /// The longest `minValid` taken: a year.
    public static let longestMinValid: Int64 = 31_536_000

    /// `minValid`, 1 to `longestMinValid` seconds; not beside `rejected` (a Recover asks for
    /// the next token, whatever its life).
    private static func minValid(of parameters: Parameters, rejected: String? = nil) throws(ParameterError) -> Int64? {
        switch parameters.object["minValid"] {
        case nil, .null?: return nil
        case let .int(seconds)? where (1...longestMinValid).contains(seconds) && rejected == nil: return seconds
        default: throw ParameterError(name: "minValid")
        }
    }

    /// The parameters to send.
    public var parameters: JSONObject {
        BrokerContract.secretsRegistered
        switch self {
        case let .getToken(session, minValid, key?):
            var parameters = key.parameters
            parameters["session"] = .string(session)
            if let minValid { parameters["minValid"] = .int(minValid) }
            return parameters
        case let .getToken(session, minValid?, nil): return ["session": .string(session), "minValid": .int(minValid)]
        case let .getToken(session, nil, nil), let .watch(session), let .logout(session), let .refresh(session), let .deviceLogin(session),
             let .forget(session), let .codeLogin(session, false), let .loginFlow(session), let .resetFleetHistory(session):
            return ["session": .string(session)]
        case let .codeLogin(session, true): return ["session": .string(session), "refusals": true]
        case let .completeCodeLogin(session, redirect): return ["session": .string(session), "redirectUrl": .string(redirect)]
        case let .recover(session, rejected, key):
            var parameters = key?.parameters ?? [:]
            (parameters["session"], parameters["rejected"]) = (.string(session), .string(rejected))
            return parameters
        case let .login(session, refreshToken): return ["session": .string(session), "refreshToken": .string(refreshToken)]
        case .status, .reload, .metrics, .delegations: return [:]
        case let .delegate(request): return request.parameters
        case let .undelegate(name): return ["name": .string(name)]
        case let .clientKey(session, .show): return ["session": .string(session)]
        case let .clientKey(session, change): return ["session": .string(session), "change": .string(change.rawValue)]
        case let .audit(session, limit):
            var parameters: JSONObject = [:]
            if let session { parameters["session"] = .string(session) }
            if let limit { parameters["limit"] = .int(Int64(limit)) }
            return parameters
        case let .credential(url, rejected, minValid, key):
            var parameters = key?.parameters ?? [:]
            parameters["url"] = .string(url)
            if let rejected { parameters["rejected"] = .string(rejected) }
            if let minValid { parameters["minValid"] = .int(minValid) }
            return parameters
        case let .getProof(session, method, uri, nonce, rejected, minValid, key):
            var parameters = key?.parameters ?? [:]
            (parameters["session"], parameters["method"], parameters["uri"]) = (.string(session), .string(method), .string(uri))
            if let nonce { parameters["nonce"] = .string(nonce) }
            if let rejected { parameters["rejected"] = .string(rejected) }
            if let minValid { parameters["minValid"] = .int(minValid) }
            return parameters
        }
    }

    /// The call to send (`Watch`, `DeviceLogin` and `CodeLogin` stream, so they ask for more replies).
    public var call: VarlinkCall {
        VarlinkCall(method: method.qualifiedName, parameters: parameters, more: method.streams)
    }
}

/// A token as `GetToken`, `Recover` and `Watch` send it.
public struct TokenReply: Sendable, Equatable {
    /// The bearer credential. Never log it.
    public var token: String
    public var tokenType: String
    /// Expiry, Unix seconds.
    public var expiresAt: Int64?
    public var generation: Int

    public init(token: String, tokenType: String, expiresAt: Int64?, generation: Int) {
        BrokerContract.secretsRegistered
        self.token = token
        self.tokenType = tokenType
        self.expiresAt = expiresAt
        self.generation = generation
    }

    public init(_ parameters: JSONObject) {
        BrokerContract.secretsRegistered
        self.init(token: parameters["token"]?.stringValue ?? "", tokenType: parameters["tokenType"]?.stringValue ?? "Bearer",
                  expiresAt: parameters["expiresAt"]?.intValue, generation: Int(parameters["generation"]?.intValue ?? 0))
    }

    public var parameters: JSONObject {
        BrokerContract.secretsRegistered
        var parameters: JSONObject = ["token": .string(token), "tokenType": .string(tokenType)]
        if let expiresAt { parameters["expiresAt"] = .int(expiresAt) }
        parameters["generation"] = .int(Int64(generation))
        return parameters
    }
}

/// The reply of `Login`, and the last reply of `DeviceLogin`: the generation the login began.
public struct LoginReply: Sendable, Equatable {
    public var generation: Int

    public init(generation: Int) { self.generation = generation }

    public init(_ parameters: JSONObject) {
        self.init(generation: Int(clamping: parameters["generation"]?.intValue ?? 0))
    }

    public var parameters: JSONObject { ["generation": .int(Int64(generation))] }
}

/// The reply of `Refresh`: the new token's generation, serial and expiry (never the token).
public struct RefreshReply: Sendable, Equatable {
    public var generation: Int
    public var tokenSerial: UInt64
    public var expiresAt: Int64?

    public init(generation: Int, tokenSerial: UInt64, expiresAt: Int64?) {
        (self.generation, self.tokenSerial, self.expiresAt) = (generation, tokenSerial, expiresAt)
    }

    public init(_ parameters: JSONObject) {
        self.init(generation: Int(clamping: parameters["generation"]?.intValue ?? 0),
                  tokenSerial: parameters["tokenSerial"]?.intValue.flatMap { UInt64(exactly: $0) } ?? 0,
                  expiresAt: parameters["expiresAt"]?.intValue)
    }

    public var parameters: JSONObject {
        var parameters: JSONObject = ["generation": .int(Int64(generation)), "tokenSerial": .int(Int64(clamping: tokenSerial))]
        if let expiresAt { parameters["expiresAt"] = .int(expiresAt) }
        return parameters
    }
}

/// One reply of `DeviceLogin`: what to show the user, then the login's end.
public enum DeviceLoginEvent: Sendable, Equatable {
    /// Open `verificationUri` and enter `userCode` within `expiresIn` seconds
    /// (`verificationUriComplete` carries the code already, when the server gives one).
    case prompt(verificationUri: String, userCode: String, expiresIn: Int64, verificationUriComplete: String?)
    case done(LoginReply)

    public init(_ parameters: JSONObject) {
        if parameters["event"] == "prompt" {
            self = .prompt(verificationUri: parameters["verificationUri"]?.stringValue ?? "?", userCode: parameters["userCode"]?.stringValue ?? "?",
                           expiresIn: parameters["expiresIn"]?.intValue ?? 0,
                           verificationUriComplete: parameters["verificationUriComplete"]?.stringValue)
        } else {
            self = .done(LoginReply(parameters))
        }
    }

    public var parameters: JSONObject {
        switch self {
        case let .prompt(uri, code, expiresIn, complete):
            var parameters: JSONObject = ["event": "prompt", "verificationUri": .string(uri), "userCode": .string(code),
                                          "expiresIn": .int(expiresIn)]
            if let complete { parameters["verificationUriComplete"] = .string(complete) }
            return parameters
        case let .done(login):
            return ["event": "done", "generation": .int(Int64(login.generation))]
        }
    }
}

/// One reply of `CodeLogin`: where to send the browser, then the login's end.
public enum CodeLoginEvent: Sendable, Equatable {
    /// How `CompleteCodeLogin`'s `LoginFailed` reason ends for a pasted redirect that changed
    /// nothing: the login goes on waiting (a client tells it from the login's end by it).
    public static let stillWaiting = "; the login is still waiting"

    /// Open `authorizationUri` within `expiresIn` seconds; the server sends the browser back to
    /// `redirectUri`, the daemon's loopback listener (or its URL is pasted to `CompleteCodeLogin`).
    case prompt(authorizationUri: String, redirectUri: String, expiresIn: Int64)
    /// The listener refused a request that was not the login's answer (`reason`: why, with
    /// nothing of the request but a sanitized Host); the login goes on waiting. Only to a call
    /// that asked (`refusals`).
    case refused(reason: String)
    case done(LoginReply)

    public init(_ parameters: JSONObject) {
        if parameters["event"] == "prompt" {
            self = .prompt(authorizationUri: parameters["authorizationUri"]?.stringValue ?? "?",
                           redirectUri: parameters["redirectUri"]?.stringValue ?? "?", expiresIn: parameters["expiresIn"]?.intValue ?? 0)
        } else if parameters["event"] == "refused" {
            self = .refused(reason: parameters["reason"]?.stringValue ?? "?")
        } else {
            self = .done(LoginReply(parameters))
        }
    }

    public var parameters: JSONObject {
        switch self {
        case let .prompt(uri, redirect, expiresIn):
            return ["event": "prompt", "authorizationUri": .string(uri), "redirectUri": .string(redirect), "expiresIn": .int(expiresIn)]
        case let .refused(reason):
            return ["event": "refused", "reason": .string(reason)]
        case let .done(login):
            return ["event": "done", "generation": .int(Int64(login.generation))]
        }
    }
}

/// The interactive logins: the device authorization grant, or the authorization code grant with PKCE.
public enum LoginFlow: String, Sendable, CaseIterable {
    case device, code
}

/// The reply of `LoginFlow`.
public struct LoginFlowReply: Sendable, Equatable {
    public var flow: LoginFlow
    /// Why this flow, for people: "LoginFlow=auto, and the server has no device authorization
    /// endpoint (configured)" (nil from a daemon that does not say).
    public var reason: String?

    public init(flow: LoginFlow, reason: String? = nil) {
        self.flow = flow
        self.reason = reason
    }

    /// nil when the reply names no flow this client knows.
    public init?(_ parameters: JSONObject) {
        guard let flow = parameters["flow"]?.stringValue.flatMap(LoginFlow.init(rawValue:)) else { return nil }
        self.flow = flow
        reason = parameters["reason"]?.stringValue
    }

    public var parameters: JSONObject {
        var parameters: JSONObject = ["flow": .string(flow.rawValue)]
        if let reason { parameters["reason"] = .string(reason) }
        return parameters
    }
}

/// The reply of `ResetFleetHistory`: where the session's new fleet history starts.
public struct FleetResetReply: Sendable, Equatable {
    public var history: Int64
    public var generation: Int64

    public init(history: Int64, generation: Int64) { (self.history, self.generation) = (history, generation) }

    public init(_ parameters: JSONObject) {
        self.init(history: parameters["fleetHistory"]?.intValue ?? 0, generation: parameters["fleetGeneration"]?.intValue ?? 0)
    }

    public var parameters: JSONObject { ["fleetHistory": .int(history), "fleetGeneration": .int(generation)] }
}

/// The reply of `Metrics`: the exposition in the Prometheus text format.
public struct MetricsReply: Sendable, Equatable {
    public var text: String

    public init(text: String) { self.text = text }

    public init(_ parameters: JSONObject) { self.init(text: parameters["text"]?.stringValue ?? "") }

    public var parameters: JSONObject { ["text": .string(text)] }
}

/// The reply of `Credential`: the session that serves the URL, and its token.
public struct CredentialReply: Sendable, Equatable {
    public var session: String
    public var token: TokenReply

    public init(session: String, token: TokenReply) {
        self.session = session
        self.token = token
    }

    public init(_ parameters: JSONObject) {
        self.init(session: parameters["session"]?.stringValue ?? "", token: TokenReply(parameters))
    }

    public var parameters: JSONObject {
        var parameters = token.parameters
        parameters["session"] = .string(session)
        return parameters
    }
}

/// The reply of `GetProof`: the token, and the proof to send with it (none for a bearer token).
public struct ProofReply: Sendable, Equatable {
    public var token: TokenReply
    /// The `DPoP` header's value, for the one request it names. Never log it.
    public var proof: String?

    public init(token: TokenReply, proof: String?) {
        BrokerContract.secretsRegistered
        self.token = token
        self.proof = proof
    }

    public init(_ parameters: JSONObject) {
        self.init(token: TokenReply(parameters), proof: parameters["proof"]?.stringValue)
    }

    public var parameters: JSONObject {
        var parameters = token.parameters
        if let proof { parameters["proof"] = .string(proof) }
        return parameters
    }

    /// The request's headers: `Authorization` with the token's type, and `DPoP` when there is a proof.
    public var headers: [(name: String, value: String)] {
        var headers = [(name: "Authorization", value: token.tokenType + " " + token.token)]
        if let proof { headers.append((name: "DPoP", value: proof)) }
        return headers
    }
}

/// One reply of a `Watch` stream.
public enum WatchEvent: Sendable, Equatable {
    /// A new token (also the first reply, when the session has one); `serial` numbers the
    /// session's tokens.
    case token(TokenReply, serial: Int)
    /// The session was logged out; the stream's last reply.
    case signedOut(generation: Int)

    public init(_ parameters: JSONObject) {
        let generation = Int(parameters["generation"]?.intValue ?? 0)
        if parameters["event"] == "signedOut" {
            self = .signedOut(generation: generation)
        } else {
            self = .token(TokenReply(parameters), serial: Int(parameters["tokenSerial"]?.intValue ?? 0))
        }
    }

    public var parameters: JSONObject {
        BrokerContract.secretsRegistered
        switch self {
        case let .token(token, serial):
            var parameters: JSONObject = ["event": "token", "generation": .int(Int64(token.generation))]
            if let expiresAt = token.expiresAt { parameters["expiresAt"] = .int(expiresAt) }
            parameters["token"] = .string(token.token)
            parameters["tokenType"] = .string(token.tokenType)
            parameters["tokenSerial"] = .int(Int64(serial))
            return parameters
        case let .signedOut(generation):
            return ["event": "signedOut", "generation": .int(Int64(generation))]
        }
    }
}

/// One session as `Status` reports it (the interface's `SessionStatus`). Holds no token.
public struct StatusEntry: Sendable, Equatable {
    public var name: String
    /// `active`, `signedOut` or `ended` (kept as sent: a newer daemon may add states).
    public var state: String
    public var generation: Int
    public var tokenSerial: UInt64?
    /// Expiry of the current access token, Unix seconds.
    public var expiresAt: Int64?
    /// Last successful refresh, Unix seconds.
    public var lastRefresh: Int64?
    public var refreshing = false
    /// Seconds left in the backoff after a transient failure.
    public var backoffRemaining: Double?
    /// Why the last refresh or store write failed (never a secret).
    public var lastError: String?
    public var degraded = false
    public var counters = Counters()
    /// A stored session the configuration no longer names.
    public var inert = false
    /// Fleet sessions only: `healthy`, `starting` or `unavailable: <why>`.
    public var fleetHealth: String?
    public var fleetGeneration: Int64?
    public var fleetRevision: Int64?
    /// The broker refreshing the session for the fleet now.
    public var flightHolder: String?
    /// The uids whose share of the refresh budget is spent (their refreshes are refused, the
    /// others' are not): every one for an admin, else the caller's own at most.
    public var throttledUsers: [UInt32] = []
    /// A derived session's parent.
    public var derivedFrom: String?
    /// A parent's redemptions of its refresh token for its derived sessions (`Derivation=refresh`),
    /// when it made any.
    public var derivations: Int?
    /// A session that allows keys (`AllowResources=`, `AllowScopes=`): how many it holds now.
    public var keys: Int?

    public init(name: String, state: String, generation: Int) {
        self.name = name
        self.state = state
        self.generation = generation
    }

    /// What the session has done since the daemon started: the interface's counters, by their
    /// wire names, in the order the reply lists them.
    public enum Counter: String, Sendable, CaseIterable {
        case fetches, joinedWaiters, failures, staleRejections, throttled, droppedResults
    }

    /// The counters' values (0 for one a daemon did not send).
    public struct Counters: Sendable, Equatable {
        private var values = [Int](repeating: 0, count: Counter.allCases.count)

        public init() {}

        public subscript(_ counter: Counter) -> Int {
            get { values[Counter.allCases.firstIndex(of: counter)!] }
            set { values[Counter.allCases.firstIndex(of: counter)!] = newValue }
        }
    }

    public init(_ object: JSONObject) {
        func int(_ key: String) -> Int { Int(clamping: object[key]?.intValue ?? 0) }
        self.init(name: object["name"]?.stringValue ?? "?", state: object["state"]?.stringValue ?? "?", generation: int("generation"))
        tokenSerial = object["tokenSerial"]?.intValue.flatMap { UInt64(exactly: $0) }
        expiresAt = object["expiresAt"]?.intValue
        lastRefresh = object["lastRefresh"]?.intValue
        refreshing = object["refreshing"]?.boolValue ?? false
        backoffRemaining = object["backoffRemaining"]?.doubleValue
        lastError = object["lastError"]?.stringValue
        degraded = object["degraded"]?.boolValue ?? false
        for counter in Counter.allCases { counters[counter] = int(counter.rawValue) }
        inert = object["inert"]?.boolValue ?? false
        fleetHealth = object["fleetHealth"]?.stringValue
        fleetGeneration = object["fleetGeneration"]?.intValue
        fleetRevision = object["fleetRevision"]?.intValue
        flightHolder = object["flightHolder"]?.stringValue
        throttledUsers = (object["throttledUsers"]?.arrayValue ?? []).prefix(4096).compactMap { $0.intValue.flatMap(UInt32.init(exactly:)) }
        derivedFrom = object["derivedFrom"]?.stringValue
        derivations = object["derivations"]?.intValue.map { Int(clamping: $0) }
        keys = object["keys"]?.intValue.map { Int(clamping: $0) }
    }

    public var parameters: JSONObject {
        // Appended in order (no lookups): Status lists thousands of these.
        var entry: [(key: String, value: JSON)] = []
        entry.reserveCapacity(20)
        entry += [("name", .string(name)), ("state", .string(state)), ("generation", .int(Int64(generation)))]
        if let tokenSerial { entry.append(("tokenSerial", .int(Int64(clamping: tokenSerial)))) }
        if let expiresAt { entry.append(("expiresAt", .int(expiresAt))) }
        if let lastRefresh { entry.append(("lastRefresh", .int(lastRefresh))) }
        entry.append(("refreshing", .bool(refreshing)))
        if let backoffRemaining { entry.append(("backoffRemaining", .double(backoffRemaining))) }
        if let lastError { entry.append(("lastError", .string(lastError))) }
        entry.append(("degraded", .bool(degraded)))
        for counter in Counter.allCases { entry.append((counter.rawValue, .int(Int64(counters[counter])))) }
        if inert { entry.append(("inert", true)) }
        if let fleetHealth { entry.append(("fleetHealth", .string(fleetHealth))) }
        if let fleetGeneration { entry.append(("fleetGeneration", .int(fleetGeneration))) }
        if let fleetRevision { entry.append(("fleetRevision", .int(fleetRevision))) }
        if let flightHolder { entry.append(("flightHolder", .string(flightHolder))) }
        if !throttledUsers.isEmpty { entry.append(("throttledUsers", .array(throttledUsers.map { .int(Int64($0)) }))) }
        if let derivedFrom { entry.append(("derivedFrom", .string(derivedFrom))) }
        if let derivations { entry.append(("derivations", .int(Int64(derivations)))) }
        if let keys { entry.append(("keys", .int(Int64(keys)))) }
        return JSONObject(entry)
    }

    /// The entries of a `Status` reply.
    public static func entries(of reply: VarlinkReply) -> [StatusEntry] {
        (reply.parameters["sessions"]?.arrayValue ?? []).compactMap { $0.objectValue.map(StatusEntry.init) }
    }
}

/// Every error the interface names, with its parameters. `reply` and `init?(_:)` are the only
/// places its wire names are spelled.
public enum BrokerError: Error, Sendable, Equatable {
    case noSuchSession(session: String)
    /// `login`: how to log in again, where it is not `tokenbroker ctl login SESSION` (a test
    /// upstream's session, which takes any refresh token).
    case signedOut(session: String, login: String? = nil)
    case permissionDenied
    case refreshFailed(session: String, reason: String, retryable: Bool, retryAfter: Double?)
    case throttled(session: String, retryAfter: Double)
    case lifetimeTooShort(session: String, lifetime: Double, minValid: Double)
    case storeFailed(session: String, reason: String)
    case configurationError(reason: String)
    case loginFailed(session: String, reason: String)
    case sessionConfigured(session: String)
    case shuttingDown
    case internalError
    case protocolError(reason: String)
    case noSuchDelegation(name: String)
    case delegationFailed(name: String, reason: String)
    case clientKeyUnavailable(session: String, reason: String)

    /// `io.tokenbroker.Broker.ProtocolError`, which the varlink layer sends by name.
    public static let protocolErrorName = BrokerContract.name + ".ProtocolError"

    /// The error's name in the interface (`RefreshFailed`): the reply's error is the interface's
    /// name, a dot, and this; the metrics count calls by it.
    public var name: String {
        switch self {
        case .noSuchSession: "NoSuchSession"
        case .signedOut: "SignedOut"
        case .permissionDenied: "PermissionDenied"
        case .refreshFailed: "RefreshFailed"
        case .throttled: "Throttled"
        case .lifetimeTooShort: "LifetimeTooShort"
        case .storeFailed: "StoreFailed"
        case .configurationError: "ConfigurationError"
        case .loginFailed: "LoginFailed"
        case .sessionConfigured: "SessionConfigured"
        case .shuttingDown: "ShuttingDown"
        case .internalError: "InternalError"
        case .protocolError: "ProtocolError"
        case .noSuchDelegation: "NoSuchDelegation"
        case .delegationFailed: "DelegationFailed"
        case .clientKeyUnavailable: "ClientKeyUnavailable"
        }
    }

    /// The errors `GetToken` and `Recover` can answer (the metrics' `result` label values).
    public static let tokenCallErrors: [BrokerError] = [
        .signedOut(session: ""), .refreshFailed(session: "", reason: "", retryable: false, retryAfter: nil), .throttled(session: "", retryAfter: 0),
        .permissionDenied, .noSuchSession(session: ""), .storeFailed(session: "", reason: ""), .shuttingDown, .internalError,
        .lifetimeTooShort(session: "", lifetime: 0, minValid: 0),
    ]

    public var reply: VarlinkReply {
        let parameters: JSONObject
        switch self {
        case let .signedOut(session, login):
            var signedOut: JSONObject = ["session": .string(session)]
            if let login { signedOut["login"] = .string(login) }
            parameters = signedOut
        case let .noSuchSession(session), let .sessionConfigured(session):
            parameters = ["session": .string(session)]
        case .permissionDenied, .shuttingDown, .internalError:
            parameters = [:]
        case let .refreshFailed(session, reason, retryable, retryAfter):
            var failed: JSONObject = ["session": .string(session), "reason": .string(reason), "retryable": .bool(retryable)]
            if let retryAfter { failed["retryAfter"] = .double(retryAfter) }
            parameters = failed
        case let .throttled(session, retryAfter):
            parameters = ["session": .string(session), "retryAfter": .double(retryAfter)]
        case let .lifetimeTooShort(session, lifetime, minValid):
            parameters = ["session": .string(session), "lifetime": .double(lifetime), "minValid": .double(minValid)]
        case let .storeFailed(session, reason), let .loginFailed(session, reason), let .clientKeyUnavailable(session, reason):
            parameters = ["session": .string(session), "reason": .string(reason)]
        case let .configurationError(reason), let .protocolError(reason):
            parameters = ["reason": .string(reason)]
        case let .noSuchDelegation(name):
            parameters = ["name": .string(name)]
        case let .delegationFailed(name, reason):
            parameters = ["name": .string(name), "reason": .string(reason)]
        }
        return .error(BrokerContract.name + "." + name, parameters)
    }

    /// The contract error a reply carries; `nil` for a reply without an error or with an error
    /// of another interface. `session` fills in an error that names none.
    public init?(_ reply: VarlinkReply, session: String = "") {
        guard let name = reply.error else { return nil }
        let parameters = reply.parameters
        let session = parameters["session"]?.stringValue ?? session
        let reason = parameters["reason"]?.stringValue ?? ""
        switch name {
        case BrokerContract.name + ".NoSuchSession": self = .noSuchSession(session: session)
        case BrokerContract.name + ".SignedOut": self = .signedOut(session: session, login: parameters["login"]?.stringValue)
        case BrokerContract.name + ".PermissionDenied", VarlinkServiceError.permissionDenied: self = .permissionDenied
        case BrokerContract.name + ".RefreshFailed":
            self = .refreshFailed(session: session, reason: reason, retryable: parameters["retryable"]?.boolValue ?? false,
                                  retryAfter: parameters["retryAfter"]?.doubleValue)
        case BrokerContract.name + ".Throttled": self = .throttled(session: session, retryAfter: parameters["retryAfter"]?.doubleValue ?? 0)
        case BrokerContract.name + ".LifetimeTooShort":
            self = .lifetimeTooShort(session: session, lifetime: parameters["lifetime"]?.doubleValue ?? 0, minValid: parameters["minValid"]?.doubleValue ?? 0)
        case BrokerContract.name + ".StoreFailed": self = .storeFailed(session: session, reason: reason)
        case BrokerContract.name + ".ConfigurationError": self = .configurationError(reason: reason)
        case BrokerContract.name + ".LoginFailed": self = .loginFailed(session: session, reason: reason)
        case BrokerContract.name + ".SessionConfigured": self = .sessionConfigured(session: session)
        case BrokerContract.name + ".ShuttingDown": self = .shuttingDown
        case BrokerContract.name + ".InternalError": self = .internalError
        case BrokerContract.name + ".ProtocolError": self = .protocolError(reason: reason)
        case BrokerContract.name + ".NoSuchDelegation": self = .noSuchDelegation(name: parameters["name"]?.stringValue ?? "")
        case BrokerContract.name + ".DelegationFailed":
            self = .delegationFailed(name: parameters["name"]?.stringValue ?? "", reason: reason)
        case BrokerContract.name + ".ClientKeyUnavailable": self = .clientKeyUnavailable(session: session, reason: reason)
        default: return nil
        }
    }
}
