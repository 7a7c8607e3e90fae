import TokenBrokerCore
import WireJSON
import HTTPTransport

/// What the user must do to approve a device login (RFC 8628 §3.2).
public struct DeviceAuthorization: Sendable {
    /// The code the client polls with; a credential, never shown.
    public var deviceCode: Secret
    public var userCode: String
    public var verificationURI: String
    public var verificationURIComplete: String?
    public var expiresIn: Duration
    public var interval: Duration
}

/// Why a device login ended without tokens.
public enum DeviceLoginError: Error, Sendable, Equatable, CustomStringConvertible {
    /// The user said no (`access_denied`).
    case denied
    /// The code expired before the user approved (`expired_token`, or our own clock).
    case expired
    /// The server does not offer the device flow (no device authorization endpoint).
    case unsupported
    /// Any other failure.
    case failed(FetchFailure)

    public var description: String {
        switch self {
        case .denied: return "the login was denied (access_denied)"
        case .expired: return "the code expired before it was approved (expired_token)"
        case .unsupported: return "the authorization server has no device authorization endpoint"
        case let .failed(failure): return failure.message
        }
    }
}

extension OAuthClient {
    /// Starts a device authorization (RFC 8628 §3.1).
    public func startDeviceAuthorization() async throws(DeviceLoginError) -> DeviceAuthorization {
        guard let url = endpoints.deviceAuthorization else { throw .unsupported }
        var fields: [(String, String)] = []
        if let scope = configuration.scope { fields.append(("scope", scope)) }
        fields += configuration.loginResources.map { ("resource", $0) }
        let response: HTTPResponse
        do {
            response = try await post(url, fields, clientIDInBody: true)
        } catch {
            throw .failed(error)
        }
        guard response.status == 200 else { throw .failed(Self.classify(response)) }
        return try DeviceAuthorization.parse(response.body)
    }
}

extension DeviceAuthorization {
    /// Reads a device authorization response body (RFC 8628 §3.2).
    static func parse(_ body: [UInt8]) throws(DeviceLoginError) -> DeviceAuthorization {
        guard let object = (try? JSONParser.parse(body))?.objectValue,
              let deviceCode = object["device_code"]?.stringValue, let userCode = object["user_code"]?.stringValue,
              let uri = object["verification_uri"]?.stringValue,
              let expiresIn = UpstreamNumbers.seconds(object["expires_in"], atMost: Self.longestDeviceCode)
        else { throw .failed(.transient("malformed device authorization response")) }
        // What is shown to the operator must be a short line of plain text: no terminal escapes.
        let complete = object["verification_uri_complete"]?.stringValue
        guard Self.isDisplayable(userCode, 64), Self.isDisplayable(uri, 2048), complete.map({ Self.isDisplayable($0, 2048) }) ?? true else {
            throw .failed(.transient("malformed device authorization response (user code or URI not plain text)"))
        }
        let interval = UpstreamNumbers.seconds(object["interval"], atMost: .seconds(300)) ?? .seconds(5)
        return DeviceAuthorization(deviceCode: Secret(deviceCode), userCode: userCode, verificationURI: uri,
                                   verificationURIComplete: complete, expiresIn: expiresIn, interval: max(interval, .seconds(1)))
    }

    /// The longest a device code is believed to live (RFC 8628 suggests minutes).
    static let longestDeviceCode: Duration = .seconds(86400)

    /// Printable, single-line, not empty, at most `limit` bytes.
    static func isDisplayable(_ text: String, _ limit: Int) -> Bool {
        !text.isEmpty && text.utf8.count <= limit && text.unicodeScalars.allSatisfy(isSingleLine)
    }

    /// Not a control character (C0, DEL, C1) nor a line or paragraph separator.
    static func isSingleLine(_ scalar: Unicode.Scalar) -> Bool {
        scalar.value >= 0x20 && scalar.value != 0x7F && !(0x80...0x9F).contains(scalar.value) && scalar.value != 0x2028 && scalar.value != 0x2029
    }
}

extension OAuthClient {
    /// Polls the token endpoint until the user approves or denies, the code expires, or a hard
    /// error ends it (RFC 8628 §3.4–3.5): `authorization_pending` waits `interval`, `slow_down`
    /// adds 5 s to it for good, transient failures back off up to a minute. Cancelling the
    /// task stops it; so does `stop` turning true, checked after each wait, which never cuts
    /// off a poll under way (its answer may carry the tokens of an approved login).
    public func completeDeviceLogin<C: Clock>(_ authorization: DeviceAuthorization, clock: C, stop: @Sendable () -> Bool = { false })
        async throws(DeviceLoginError) -> FetchedToken where C.Duration == Duration {
        let deadline = clock.now.advanced(by: authorization.expiresIn)
        var interval = authorization.interval
        var wait = interval
        while true {
            do {
                try await clock.sleep(until: clock.now.advanced(by: wait), tolerance: nil)
            } catch {
                throw .failed(.transient("cancelled"))
            }
            if stop() { throw .failed(.transient("cancelled")) }
            guard clock.now < deadline else { throw .expired }
            let response: HTTPResponse
            do {
                response = try await tokenEndpointPost([("grant_type", "urn:ietf:params:oauth:grant-type:device_code"),
                                                        ("device_code", authorization.deviceCode.reveal)], clientIDInBody: true)
            } catch {
                if error.reason == "cancelled" { throw .failed(error) }
                wait = min(wait * 2, .seconds(60))   // network trouble: back off
                continue
            }
            if response.status == 200 {
                do { return try await accept(response) } catch { throw .failed(error) }
            }
            switch Self.errorCode(response) {
            case "authorization_pending":
                wait = interval
            case "slow_down":
                interval += .seconds(5)
                wait = interval
            case "access_denied":
                throw .denied
            case "expired_token":
                throw .expired
            default:
                let failure = Self.classify(response)
                // A bare 4xx while polling: keep polling until the code expires, as before.
                switch failure.kind {
                case .transient, .refused: break
                case .terminal: throw .failed(failure)
                }
                wait = min(max(wait * 2, interval), .seconds(60))
            }
        }
    }
}
