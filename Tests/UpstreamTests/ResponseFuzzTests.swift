import Testing
import Basics
import TestSupport
import TokenBrokerCore
@testable import Upstream
import WireJSON
import HTTPTransport

/// What an authorization server answers — token responses, device authorizations, discovery
/// metadata, error bodies, Retry-After — built at random from hostile pieces: every answer ends
/// in a value or a classified failure, never a trap. `TB_FUZZ_ITERATIONS` (default 20,000) and
/// `TB_FUZZ_SEED` (printed) as for the varlink fuzzing (a tenth of the count here: each answer is
/// larger).
@Suite("Upstream response fuzzing")
struct ResponseFuzzTests {
    static let numbers: [JSON] = [
        .int(0), .int(-1), .int(1), .int(3600), .int(Int64.max), .int(Int64.min), .double(1e300), .double(-1e300),
        .double(.leastNonzeroMagnitude), .double(0.5), .double(9.3e18), .double(-9.3e18), .string("3600"), .string("NaN"), .string("inf"),
        .string("-inf"), .string("1e400"), .string(String(repeating: "9", count: 400)), .string("0x10"), .string(""),
    ]
    static let strings: [JSON] = [
        .string("Bearer"), .string("bearer"), .string("DPoP"), .string(""), .string("dev-at.x+/="), .string("\u{1B}[31mred"),
        .string("line\nbreak"), .string("https://as.example/device"), .string("http://10.0.0.1/token"), .string("\u{202E}"),
        .string(String(repeating: "A", count: 700)), .string("https://as.example"), .string("ABCD-EFGH"), .string("invalid_grant"), .string("slow_down"),
    ]
    static let keys = ["access_token", "token_type", "expires_in", "refresh_token", "scope", "device_code", "user_code",
                       "verification_uri", "verification_uri_complete", "interval", "issuer", "token_endpoint",
                       "revocation_endpoint", "device_authorization_endpoint", "token_endpoint_auth_methods_supported", "error",
                       "error_description"]

    static func value(_ random: inout SeededRandom, depth: Int = 0) -> JSON {
        switch random.next() % 8 {
        case 0, 1: return random.pick(numbers)
        case 2, 3: return random.pick(strings)
        case 4: return .bool(random.next() % 2 == 0)
        case 5: return .null
        case 6 where depth < 3: return .array((0..<Int(random.next() % 4)).map { _ in value(&random, depth: depth + 1) })
        default: return depth < 3 ? .object(object(&random, depth: depth + 1)) : .null
        }
    }

    /// Valid answers of each kind, for mutation.
    static let templates: [JSONObject] = [
        ["access_token": "a", "token_type": "Bearer", "expires_in": 3600, "refresh_token": "r"],
        ["device_code": "d", "user_code": "ABCD-EFGH", "verification_uri": "https://as.example/device", "expires_in": 600, "interval": 5],
        ["issuer": "https://as.example", "token_endpoint": "https://as.example/token"],
    ]

    static func object(_ random: inout SeededRandom, depth: Int = 0) -> JSONObject {
        var object = depth == 0 && random.next() % 2 == 0 ? random.pick(templates) : JSONObject()
        for key in keys where random.next() % (object.isEmpty ? 3 : 6) == 0 { object[key] = value(&random, depth: depth) }
        return object
    }

    static func body(_ random: inout SeededRandom) -> [UInt8] {
        var output: [UInt8] = []
        switch random.next() % 10 {
        case 0: return Array("not json".utf8)
        case 1: return []
        case 2: JSON.array([.object(object(&random))]).encode(into: &output)
        default: JSON.object(object(&random)).encode(into: &output)
        }
        return output
    }

    @Test("token, device authorization, discovery and error answers never trap")
    func responses() {
        let iterations = SeededRandom.iterations(default: 20_000) / 10
        let seed = SeededRandom.seed()
        print("upstream fuzz: \(iterations) answers, TB_FUZZ_SEED=\(seed)")
        var random = SeededRandom(seed: seed)
        var tokens = 0, devices = 0, metadata = 0
        for _ in 0..<iterations {
            let body = Self.body(&random)
            let status = random.pick([200, 400, 401, 403, 429, 500, 503, 302, 0, 999])
            let retryAfter = random.pick([nil, 0, 1, 120, Int.max, Int(Int32.max)])
            let response = HTTPResponse(status: status, headers: [], body: body, retryAfter: retryAfter)
            if let token = try? OAuthClient.parseToken(response) {
                tokens += 1
                if let expiresIn = token.expiresIn { #expect(expiresIn > .zero && expiresIn <= UpstreamNumbers.longestLifetime) }
            }
            if case let .transient(wait?) = OAuthClient.classify(response).kind { #expect(wait <= UpstreamNumbers.longestRetryAfter) }
            if let device = try? DeviceAuthorization.parse(body) {
                devices += 1
                #expect(device.expiresIn > .zero && device.interval >= .seconds(1) && device.interval <= .seconds(300))
                #expect(!device.userCode.unicodeScalars.contains { $0.value < 0x20 })
            }
            if let object = (try? JSONParser.parse(body))?.objectValue,
               (try? AuthorizationServerMetadata(object, issuer: "https://as.example", url: "https://as.example/m")) != nil {
                metadata += 1
            }
        }
        print("upstream fuzz: \(tokens) token answers, \(devices) device authorizations, \(metadata) metadata documents accepted")
    }

    @Test("a token's lifetime counts from the second its request was sent in, and a JWT access token's exp shortens it: exp - iat as a lifetime, an exp without iat as an instant while it lies ahead; nothing traps (issue 32)")
    func lifetimes() throws {
        func answer(_ accessToken: String, expiresIn: Int? = 3600, requestedAt: Int64? = 1_800_000_000) throws -> FetchedToken {
            var body: JSONObject = ["access_token": .string(accessToken), "token_type": "Bearer"]
            if let expiresIn { body["expires_in"] = .int(Int64(expiresIn)) }
            var response = HTTPResponse(status: 200, headers: [], body: JSON.object(body).encoded, retryAfter: nil)
            response.requestedAt = requestedAt
            return try OAuthClient.parseToken(response)
        }
        func jwt(_ claims: JSON) -> String {
            Base64.urlEncode(JSON.object(["alg": "none"]).encoded) + "." + Base64.urlEncode(claims.encoded) + ".sig"
        }
        let opaque = try answer("opaque")
        #expect(opaque.expiresIn == .seconds(3600) && opaque.lifetimeStart == 1_800_000_000 && opaque.notAfter == nil)
        // Received 0.9 s into the second after the one it was sent in: counted from the sending.
        #expect(opaque.expiresAt(receivedAt: 1_800_000_001.9) == 1_800_003_600)
        #expect(try answer(jwt(["iat": 1_000, "exp": 1_060])).expiresIn == .seconds(60), "exp - iat is shorter")
        #expect(try answer(jwt(["iat": 1_000, "exp": 9_000])).expiresIn == .seconds(3600), "expires_in is shorter")
        #expect(try answer(jwt(["iat": 1_000, "exp": 1_060]), expiresIn: nil).expiresIn == .seconds(60), "a JWT alone says the lifetime")
        let now = UTCTime.unixSeconds()
        let instant = try answer(jwt(["exp": .int(now + 30)]))
        #expect(instant.notAfter == now + 30 && instant.expiresAt(receivedAt: Double(now)) == Double(now + 30))
        #expect(try answer(jwt(["exp": .int(now - 30)])).notAfter == nil, "an exp behind this clock, with no iat: the clocks disagree")
        for claims: JSON in [["iat": .int(.min), "exp": .int(.max)], ["exp": "soon"], ["exp": 1e300], ["iat": "then", "exp": 5], "x"] {
            #expect(try answer(jwt(claims)).expiresIn == .seconds(3600), "\(claims)")
        }
        // Fractions count (RFC 7519 NumericDate); an exp not after iat is a token dead at birth.
        #expect(try answer(jwt(["iat": 1000.5, "exp": 1060.25])).expiresIn == .milliseconds(59_750))
        #expect(try answer(jwt(["iat": 5, "exp": 1])).expiresIn == .zero && answer(jwt(["iat": 5, "exp": 5])).expiresIn == .zero)
        #expect(try answer("a.b.c").expiresIn == .seconds(3600) && answer("opaque", requestedAt: nil).lifetimeStart == nil)
    }

    @Test("the answer that crashed the daemon: device authorization expires_in 1e300, interval 1e300")
    func hugeDeviceNumbers() throws {
        let body = Array(#"{"device_code":"d","user_code":"ABCD-EFGH","verification_uri":"https://as.example/device","expires_in":1e300,"interval":1e300}"#.utf8)
        let device = try DeviceAuthorization.parse(body)
        #expect(device.expiresIn == DeviceAuthorization.longestDeviceCode && device.interval == .seconds(300))
        let token = try OAuthClient.parseToken(HTTPResponse(status: 200, headers: [], body: Array(
            #"{"access_token":"a","token_type":"Bearer","expires_in":1e300}"#.utf8), retryAfter: nil))
        #expect(token.expiresIn == UpstreamNumbers.longestLifetime)
        #expect(OAuthClient.classify(HTTPResponse(status: 429, headers: [], body: [], retryAfter: Int.max)).kind
                == .transient(retryAfter: UpstreamNumbers.longestRetryAfter))
    }
}
