#if canImport(Glibc)
import Glibc
#endif
import Basics
import DPoP
import Synchronization
import TokenBrokerCore
import WireJSON

/// What a client assertion's `aud` names (`ClientAssertionAudience=`).
public enum AssertionAudience: Sendable, Equatable {
    /// The issuer identifier (the current best practice, draft-ietf-oauth-rfc7523bis): the
    /// default when `Issuer=` is set.
    case issuer(String)
    /// The token endpoint's URL, whatever the request (RFC 7523 §3's example; the default
    /// without `Issuer=`).
    case tokenEndpoint
    /// The URL the request goes to (the token, revocation or device endpoint): servers such
    /// as Okta want each endpoint named.
    case endpoint
    /// A value the server names.
    case value(String)

    /// The `aud` of an assertion for a request to `url` at a server whose token endpoint is `tokenEndpoint`.
    func name(url: String, tokenEndpoint: String) -> String {
        switch self {
        case let .issuer(issuer): return issuer
        case .tokenEndpoint: return tokenEndpoint
        case .endpoint: return url
        case let .value(value): return value
        }
    }
}

/// How a token request's client assertion is made (`ClientAuthentication=private_key_jwt`,
/// RFC 7523 §2.2): signed here with a key, or read from a file a platform keeps fresh.
public enum ClientAssertion: Sendable {
    /// A JWT signed per request with `key` and `algorithm`: `iss` = `sub` = the client id,
    /// `aud` as `audience` says, a fresh `jti`, `iat`, and `exp` `lifetime` later.
    case signed(key: SigningKey, algorithm: SigningKey.Algorithm, audience: AssertionAudience)
    /// The JWT a file holds (`ClientAssertionFile=`), as it is at the request.
    case file(AssertionFile)

    public static let type = "urn:ietf:params:oauth:client-assertion-type:jwt-bearer"
    /// How long a signed assertion is valid: one request's worth (servers keep its `jti` that
    /// long to refuse a replay).
    public static let lifetime: Int64 = 60

    /// The assertion for one request by `clientID` to `url`.
    public func assertion(clientID: String, url: String, tokenEndpoint: String) throws(FetchFailure) -> String {
        switch self {
        case let .signed(key, algorithm, audience):
            let now = UTCTime.unixSeconds()
            let claims: JSONObject = ["iss": .string(clientID), "sub": .string(clientID),
                                      "aud": .string(audience.name(url: url, tokenEndpoint: tokenEndpoint)),
                                      "jti": .string(DPoPProof.randomJTI()), "iat": .int(now), "exp": .int(now + Self.lifetime)]
            do { return try key.jwt(claims, algorithm) } catch { throw .transient("client assertion: \(error.description)") }
        case let .file(file):
            return try file.read()
        }
    }
}

/// Where a session's client assertions come from; the daemon's key holder, an operator's key
/// (`ClientKeyFile=`), or a platform's file. `prepare` runs before each client is made (it may
/// make and keep a key), so that the assertion of each request is made without waiting.
public protocol ClientAssertionSource: Sendable {
    /// The assertion maker for requests to a server whose metadata lists `serverAlgorithms`
    /// (`token_endpoint_auth_signing_alg_values_supported`; nil: it lists none, or no `Issuer=`).
    func prepare(serverAlgorithms: [String]?) async throws(FetchFailure) -> ClientAssertion
}

/// The algorithm a key signs with for a server that lists `listed` (nil: any), `configured`
/// winning (`ClientAssertionAlgorithm=`): the key's default where the server takes it, else
/// another of its family the server lists. Nil when the two cannot agree.
public func assertionAlgorithm(for key: SigningKey, configured: SigningKey.Algorithm?, listed: [String]?) -> SigningKey.Algorithm? {
    if let configured { return key.signs(configured) ? configured : nil }
    guard let listed else { return key.defaultAlgorithm }
    if listed.contains(key.defaultAlgorithm.rawValue) { return key.defaultAlgorithm }
    return SigningKey.Algorithm.allCases.first { key.signs($0) && listed.contains($0.rawValue) }
}

/// The algorithm a key made for a server that lists `listed` should sign with: `configured`,
/// else ES256 unless the server lists only RSA ones (RS256 before PS256). Nil: it lists none
/// tokenbroker signs with.
public func algorithmForNewKey(configured: SigningKey.Algorithm?, listed: [String]?) -> SigningKey.Algorithm? {
    if let configured { return configured }
    guard let listed else { return .es256 }
    return SigningKey.Algorithm.allCases.first { listed.contains($0.rawValue) }
}

/// An operator's key (`ClientKeyFile=`, `ClientKeyCredential=`), read with the configuration.
public struct OperatorClientKey: ClientAssertionSource {
    public let key: SigningKey
    public let algorithm: SigningKey.Algorithm?
    public let audience: AssertionAudience

    public init(key: SigningKey, algorithm: SigningKey.Algorithm?, audience: AssertionAudience) {
        (self.key, self.algorithm, self.audience) = (key, algorithm, audience)
    }

    public func prepare(serverAlgorithms: [String]?) async throws(FetchFailure) -> ClientAssertion {
        guard let chosen = assertionAlgorithm(for: key, configured: algorithm, listed: serverAlgorithms) else {
            throw .transient("client configuration: the server takes client assertions signed with "
                            + "\((serverAlgorithms ?? []).prefix(8).joined(separator: ", ")) only; ClientKeyFile='s \(key.family.rawValue) key "
                            + (algorithm.map { "cannot sign \($0.rawValue)" } ?? "signs none of them"))
        }
        return .signed(key: key, algorithm: chosen, audience: audience)
    }
}

/// A JWT a platform keeps fresh in a file (`ClientAssertionFile=`, `AssertionFile=`: a
/// Kubernetes projected service-account token, a CI OIDC token, a SPIFFE JWT-SVID). Read again
/// only when the file changed (by `stat`: device, inode, size, change and modification times):
/// a request costs one `stat` when it did not. A file swapped while it is read (kubelet's
/// atomic symlink swap, or a writer that renames) is read whole, old or new; a read that saw
/// the file change under it is read again, and what is read must be one whole JWT (three
/// base64url parts, a JSON header and payload, a signature as long as its algorithm's), not yet
/// expired. Every failure is transient, with its reason: the platform may fix the file. (A
/// writer that rewrites the file in place, twice within one tick of the file system's clock and
/// at the same size, may be read late: platforms swap the file whole, as they should.)
public final class AssertionFile: Sendable {
    public let path: String
    /// What the failures call it (`client assertion`, `assertion`).
    let role: String
    private let cached = Mutex<(identity: FileIdentity, jwt: String, expiry: Int64?)?>(nil)
    /// Reads of the file (not counting unchanged ones): for tests and benchmarks.
    private let readCount = Atomic<Int>(0)

    /// The longest assertion read: kubelet's tokens are about 1 KiB, SPIFFE's a few.
    public static let longest = 16 << 10

    public init(path: String, role: String = "client assertion") {
        self.path = path
        self.role = role
    }

    public var reads: Int { readCount.load(ordering: .relaxed) }

    struct FileIdentity: Equatable {
        var device: UInt64, inode: UInt64, size: Int64, modified: timespec, changed: timespec

        init(_ info: stat) {
            (device, inode, size, modified, changed) = (UInt64(info.st_dev), UInt64(info.st_ino), Int64(info.st_size), info.st_mtim, info.st_ctim)
        }

        static func == (a: Self, b: Self) -> Bool {
            a.device == b.device && a.inode == b.inode && a.size == b.size && a.modified.tv_sec == b.modified.tv_sec
                && a.modified.tv_nsec == b.modified.tv_nsec && a.changed.tv_sec == b.changed.tv_sec && a.changed.tv_nsec == b.changed.tv_nsec
        }
    }

    /// The file's JWT as it is now.
    public func read() throws(FetchFailure) -> String {
        var info = stat()
        guard stat(path, &info) == 0 else { throw failure("cannot read \(path): \(String(cString: strerror(errno)))") }
        // (A device or a FIFO is not opened at all: opening some has effects.)
        guard info.st_mode & S_IFMT == S_IFREG else { throw failure("\(path) is not a regular file") }
        let identity = FileIdentity(info)
        if let cached = cached.withLock({ $0 }), cached.identity == identity {
            try checkExpiry(cached.expiry)
            return cached.jwt
        }
        // Changed (or never read): read whole. A writer that changes it in place may be caught
        // half-way: read again while the descriptor's file changes under the read.
        var lastProblem = ""
        for _ in 0..<3 {
            switch readOnce() {
            case let .success((identity, jwt, expiry)):
                cached.withLock { $0 = (identity, jwt, expiry) }
                readCount.add(1, ordering: .relaxed)
                try checkExpiry(expiry)
                return jwt
            case let .failure(problem):
                guard problem.retry else { throw failure(problem.reason) }
                lastProblem = problem.reason
            }
        }
        throw failure(lastProblem)
    }

    struct Problem: Error {
        var reason: String
        /// The file changed while it was read, or what was read was not whole: worth a second look.
        var retry = false
    }

    private func readOnce() -> Result<(FileIdentity, String, Int64?), Problem> {
        let descriptor = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK)
        guard descriptor >= 0 else { return .failure(Problem(reason: "cannot read \(path): \(String(cString: strerror(errno)))")) }
        defer { close(descriptor) }
        var before = stat()
        guard fstat(descriptor, &before) == 0 else { return .failure(Problem(reason: "cannot read \(path): \(String(cString: strerror(errno)))")) }
        guard before.st_mode & S_IFMT == S_IFREG else { return .failure(Problem(reason: "\(path) is not a regular file")) }
        guard before.st_size <= Self.longest else { return .failure(Problem(reason: "\(path) is larger than \(Self.longest / 1024) KiB")) }
        var bytes = [UInt8](repeating: 0, count: Self.longest + 1)
        var count = 0
        while count < bytes.count {
            let got = bytes.withUnsafeMutableBytes { Glibc.read(descriptor, $0.baseAddress! + count, $0.count - count) }
            if got < 0, errno == EINTR { continue }
            guard got >= 0 else { return .failure(Problem(reason: "cannot read \(path): \(String(cString: strerror(errno)))")) }
            if got == 0 { break }
            count += got
        }
        var after = stat()
        guard fstat(descriptor, &after) == 0 else { return .failure(Problem(reason: "cannot read \(path): \(String(cString: strerror(errno)))")) }
        let identity = FileIdentity(after)
        guard identity == FileIdentity(before), count == Int(after.st_size) else {
            return .failure(Problem(reason: "\(path) changed while it was read", retry: true))
        }
        guard count <= Self.longest else { return .failure(Problem(reason: "\(path) is larger than \(Self.longest / 1024) KiB")) }
        var text = bytes[..<count]
        while let last = text.last, last == UInt8(ascii: "\n") || last == UInt8(ascii: "\r") || last == UInt8(ascii: " ") { text = text.dropLast() }
        guard !text.isEmpty else { return .failure(Problem(reason: "\(path) is empty", retry: true)) }
        switch Self.check(text) {
        case let .success(expiry): return .success((identity, String(decoding: text, as: UTF8.self), expiry))
        case let .failure(problem): return .failure(Problem(reason: "\(path) \(problem.reason)", retry: true))
        }
    }

    /// Whether `text` is one whole compact JWS whose payload is a JSON object; its `exp`.
    static func check(_ text: ArraySlice<UInt8>) -> Result<Int64?, Problem> {
        let parts = text.split(separator: UInt8(ascii: "."), omittingEmptySubsequences: false)
        guard parts.count == 3, parts.allSatisfy({ !$0.isEmpty && $0.allSatisfy(Self.isBase64URL) }),
              let headerBytes = Base64.urlDecode(String(decoding: parts[0], as: UTF8.self)),
              let payloadBytes = Base64.urlDecode(String(decoding: parts[1], as: UTF8.self)),
              let signature = Base64.urlDecode(String(decoding: parts[2], as: UTF8.self)),
              case let .object(header)? = try? JSONParser.parse(ArraySlice(headerBytes)),
              case let .object(claims)? = try? JSONParser.parse(ArraySlice(payloadBytes)) else {
            return .failure(Problem(reason: "does not hold one compact JWT"))
        }
        // A signature cut short by a write caught half-way: as long as its algorithm's.
        let alg = header["alg"]?.stringValue ?? ""
        guard !alg.isEmpty, alg.lowercased() != "none" else { return .failure(Problem(reason: "holds an unsigned JWT")) }
        let whole: Bool
        switch alg.prefix(2) {
        case "ES": whole = signature.count == ["ES256": 64, "ES384": 96, "ES512": 132][alg, default: signature.count]
        case "RS", "PS": whole = signature.count >= 256 && signature.count % 128 == 0
        default: whole = !signature.isEmpty
        }
        guard whole else { return .failure(Problem(reason: "holds a JWT whose signature is cut short")) }
        guard let exp = claims["exp"] else { return .success(nil) }
        guard let seconds = exp.doubleValue, seconds.isFinite, abs(seconds) < 1e15 else {
            return .failure(Problem(reason: "holds a JWT whose exp is not a number"))
        }
        return .success(Int64(seconds.rounded(.down)))
    }

    private static func isBase64URL(_ byte: UInt8) -> Bool {
        (0x41...0x5A).contains(byte) || (0x61...0x7A).contains(byte) || (0x30...0x39).contains(byte) || byte == 0x2D || byte == 0x5F
    }

    private func checkExpiry(_ expiry: Int64?) throws(FetchFailure) {
        guard let expiry else { return }
        let now = UTCTime.unixSeconds()
        if expiry <= now { throw failure("\(path) holds a JWT that expired \(now - expiry)s ago (is whatever renews it running?)") }
    }

    private func failure(_ reason: String) -> FetchFailure {
        .transient("\(role): \(reason)")
    }
}
