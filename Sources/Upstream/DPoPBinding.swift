import Basics
import DPoP
import Synchronization
import TokenBrokerCore
import WireJSON
import HTTPTransport

/// Whether a session's tokens are DPoP-bound (`DPoP=`).
public enum DPoPMode: String, Sendable, Equatable {
    /// Bearer tokens.
    case off = "no"
    /// Every login makes a key, and every request proves it.
    case on = "yes"
    /// As `on` when the server's metadata (`Issuer=`) lists ES256 among its
    /// `dpop_signing_alg_values_supported`, else bearer tokens: decided at each login.
    case auto
}

/// The DPoP side (RFC 9449) of a session's token requests: the generation's key, which signs a
/// proof for each request, and the nonces servers asked for.
public struct DPoPBinding: Sendable {
    public let key: DPoPKey
    public let nonces: DPoPNonces
    /// `DPoP=yes`: a bearer answer is refused (with `auto` it is taken: the server does not bind).
    public let required: Bool
    /// The client the requests authenticate as: servers may keep a nonce per client
    /// (Glewlwyd does), so nonces are kept per server and client.
    public let client: String

    public init(key: DPoPKey, client: String, required: Bool = true, nonces: DPoPNonces = .shared) {
        self.key = key
        self.client = client
        self.required = required
        self.nonces = nonces
    }

    /// A new key for a login, in the form the store keeps (`SessionRecord.proofKey`: the
    /// PKCS #8 DER in base64, sealed by the store).
    public static func newKey() throws(FetchFailure) -> Secret {
        do { return Secret(Base64.encode(try DPoPKey().sealedForm)) } catch { throw .transient("dpop: \(error.description)") }
    }

    /// The key a record keeps.
    public static func key(_ kept: Secret) throws(FetchFailure) -> DPoPKey {
        guard let der = Base64.decode(kept.reveal) else { throw .terminal("dpop: the session's kept key is damaged; log in again") }
        do { return try DPoPKey(der: der) } catch { throw .terminal("dpop: \(error.description); log in again") }
    }

    /// A proof for a `method` request to `url`, with `nonce`, by default the one that server
    /// asked this client for last.
    func proof(method: String, url: String, nonce given: String? = nil) throws(FetchFailure) -> (proof: String, nonce: String?) {
        let nonce = given ?? nonces.nonce(for: url, client: client)
        do {
            return (try DPoPProof.make(key: key, method: method, url: url, issuedAt: UTCTime.unixSeconds(), nonce: nonce), nonce)
        } catch {
            throw .transient("dpop: \(error.description)")
        }
    }

    /// What an access token says of its key.
    public enum Binding: Sendable, Equatable {
        /// Nothing: an opaque token, or a JWT without `cnf` (only the server knows then).
        case none
        /// A JWT's `cnf.jkt`.
        case key(String)
        /// A JWT with a `cnf` that names no thumbprint this broker can compare.
        case unreadable
    }

    /// The key an access token says it is bound to (`cnf.jkt` of a JWT; the token is at most
    /// 16 KiB, so is the work).
    public static func binding(ofAccessToken token: String) -> Binding {
        binding(ofClaims: claims(ofAccessToken: token))
    }

    static func binding(ofClaims claims: JSONObject?) -> Binding {
        guard let cnf = claims?["cnf"] else { return .none }
        guard let jkt = cnf.objectValue?["jkt"]?.stringValue else { return .unreadable }
        return .key(jkt)
    }

    /// The claims of an access token that is a JWT (three base64url parts, a JSON object in the
    /// middle; its signature is the resource's to check, not ours), else nil. Bounded by the
    /// token's own bound (16 KiB).
    static func claims(ofAccessToken token: String) -> JSONObject? {
        let parts = token.utf8.split(separator: UInt8(ascii: "."), omittingEmptySubsequences: false)
        guard parts.count == 3, let payload = Base64.urlDecode(String(decoding: parts[1], as: UTF8.self)),
              case let .object(claims)? = try? JSONParser.parse(ArraySlice(payload)) else { return nil }
        return claims
    }
}

/// The `DPoP-Nonce` each server gave last (RFC 9449 §8, §9), by origin: a proof to that server
/// carries it. Shared by the sessions of one daemon (a nonce is the server's, not a session's);
/// bounded, and only a short visible-ASCII value is kept.
public final class DPoPNonces: Sendable {
    public static let shared = DPoPNonces()

    /// Servers remembered at most (the oldest is forgotten first).
    static let capacity = 256
    /// The longest nonce kept (RFC 9449 §8.1: 1*NQCHAR; servers send a few dozen bytes).
    static let longestNonce = 512

    private let table = Mutex<(nonces: [String: String], order: [String])>(([:], []))

    public init() {}

    /// The nonce `url`'s server gave `client`, if it gave one.
    public func nonce(for url: String, client: String) -> String? {
        guard let origin = Self.origin(url) else { return nil }
        return table.withLock { $0.nonces[origin + " " + client] }
    }

    /// Keeps the `DPoP-Nonce` of `response` from `url` to `client`; returns it (nil: none, or
    /// not a valid one).
    @discardableResult
    func learn(_ response: HTTPResponse, from url: String, client: String) -> String? {
        guard let nonce = response.header("dpop-nonce"), !nonce.isEmpty, nonce.utf8.count <= Self.longestNonce,
              nonce.utf8.allSatisfy({ $0 >= 0x21 && $0 <= 0x7E && $0 != UInt8(ascii: "\"") && $0 != UInt8(ascii: "\\") }),
              let server = Self.origin(url) else { return nil }
        let origin = server + " " + client
        table.withLock { table in
            if table.nonces.updateValue(nonce, forKey: origin) == nil {
                table.order.append(origin)
                if table.order.count > Self.capacity { table.nonces[table.order.removeFirst()] = nil }
            }
        }
        return nonce
    }

    /// `scheme://authority` of an http(s) URL.
    static func origin(_ url: String) -> String? {
        // (`target` has a scheme, `://`, an authority and a path that starts with `/`.)
        guard let target = DPoPProof.target(url) else { return nil }
        let scheme = target.hasPrefix("https://") ? 8 : 7
        let rest = target.dropFirst(scheme)
        return String(target[..<(rest.firstIndex(of: "/") ?? rest.endIndex)])
    }
}
