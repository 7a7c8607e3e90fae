import DevIssuer
import Synchronization
import Testing
import TokenBrokerCore
@testable import Upstream

/// A clock whose sleeps return at once after advancing virtual time and telling the test.
final class SteppingClock: Clock, @unchecked Sendable {
    // @unchecked: `hook` is set before use and only called from the sleeping task.
    struct Instant: InstantProtocol {
        var offset: Duration
        func advanced(by duration: Duration) -> Instant { Instant(offset: offset + duration) }
        func duration(to other: Instant) -> Duration { other.offset - offset }
        static func < (lhs: Instant, rhs: Instant) -> Bool { lhs.offset < rhs.offset }
    }

    private let current = Mutex(Instant(offset: .zero))
    private let sleeps = Mutex<[Duration]>([])
    var hook: (Int) -> Void = { _ in }

    var now: Instant { current.withLock { $0 } }
    var minimumResolution: Duration { .zero }
    var requestedSleeps: [Duration] { sleeps.withLock { $0 } }

    func sleep(until deadline: Instant, tolerance: Duration?) async throws {
        let count = sleeps.withLock { sleeps in
            sleeps.append(deadline.offset - now.offset)
            return sleeps.count
        }
        current.withLock { $0 = deadline }
        hook(count)
    }
}

@Suite("Device flow (RFC 8628) against the development issuer", .serialized)
struct DeviceFlowTests {
    static func setup(interval: Duration = .zero) throws -> (DevIssuer, OAuthClient) {
        var options = DevIssuer.Options()
        options.deviceInterval = interval
        let issuer = try DevIssuer(options: options)
        let client = OAuthClient(endpoints: OAuthEndpoints(token: issuer.tokenEndpoint, deviceAuthorization: issuer.deviceAuthorizationEndpoint),
                                 configuration: OAuthClientConfiguration(clientID: "tokenbroker", clientSecret: Secret("dev-secret")))
        return (issuer, client)
    }

    @Test("pending, then approved: tokens with a refresh token")
    func approved() async throws {
        let (issuer, client) = try Self.setup()
        defer { issuer.stop() }
        let authorization = try await client.startDeviceAuthorization()
        #expect(authorization.verificationURI == issuer.baseURL + "/device")
        #expect(authorization.verificationURIComplete?.hasSuffix("user_code=" + authorization.userCode) == true)
        let clock = SteppingClock()
        clock.hook = { count in if count == 3 { issuer.decide(userCode: authorization.userCode, approve: true) } }
        let token = try await client.completeDeviceLogin(authorization, clock: clock)
        #expect(token.refreshToken != nil && issuer.isValidAccessToken(token.accessToken.reveal))
        #expect(issuer.counters.deviceGrants == 3)
    }

    @Test("denied ends with access_denied; our own clock ends an unapproved code at expires_in")
    func deniedAndExpired() async throws {
        let (issuer, client) = try Self.setup()
        defer { issuer.stop() }
        let denied = try await client.startDeviceAuthorization()
        let clock = SteppingClock()
        clock.hook = { _ in issuer.decide(userCode: denied.userCode, approve: false) }
        await #expect(throws: DeviceLoginError.denied) { try await client.completeDeviceLogin(denied, clock: clock) }

        let ignored = try await client.startDeviceAuthorization()
        await #expect(throws: DeviceLoginError.expired) { try await client.completeDeviceLogin(ignored, clock: SteppingClock()) }
    }

    @Test("slow_down adds 5 s to the interval for good")
    func slowDown() async throws {
        let (issuer, client) = try Self.setup(interval: .seconds(10))
        defer { issuer.stop() }
        let authorization = try await client.startDeviceAuthorization()
        #expect(authorization.interval == .seconds(10))
        let clock = SteppingClock()
        // Virtual sleeps are instant, so every poll after the first comes "too soon".
        clock.hook = { count in if count == 4 { issuer.decide(userCode: authorization.userCode, approve: true) } }
        _ = try await client.completeDeviceLogin(authorization, clock: clock)
        #expect(clock.requestedSleeps == [.seconds(10), .seconds(10), .seconds(15), .seconds(20)])
    }

    @Test("a server without a device endpoint says so")
    func unsupported() async throws {
        let (issuer, _) = try Self.setup()
        defer { issuer.stop() }
        let client = OAuthClient(endpoints: OAuthEndpoints(token: issuer.tokenEndpoint),
                                 configuration: OAuthClientConfiguration(clientID: "tokenbroker", clientSecret: Secret("dev-secret")))
        await #expect(throws: DeviceLoginError.unsupported) { try await client.startDeviceAuthorization() }
    }

    @Test("client_secret_basic against a server that wants client_id in the form too (oauthlib): both device requests carry it, and the login completes")
    func clientIDInBody() async throws {
        var options = DevIssuer.Options()
        options.deviceInterval = .zero
        options.deviceRequiresClientIDInBody = true
        let issuer = try DevIssuer(options: options)
        defer { issuer.stop() }
        let client = OAuthClient(endpoints: OAuthEndpoints(token: issuer.tokenEndpoint, deviceAuthorization: issuer.deviceAuthorizationEndpoint),
                                 configuration: OAuthClientConfiguration(clientID: "tokenbroker", clientSecret: Secret("dev-secret"),
                                                                         authentication: .basic))
        let authorization = try await client.startDeviceAuthorization()
        let clock = SteppingClock()
        clock.hook = { _ in issuer.decide(userCode: authorization.userCode, approve: true) }
        let token = try await client.completeDeviceLogin(authorization, clock: clock)
        #expect(issuer.isValidAccessToken(token.accessToken.reveal))
        #expect(issuer.counters.deviceAuthorizations == 1 && issuer.counters.deviceGrants == 1)
        // A client_id in the form that names another client than the Basic credentials is refused.
        let other = OAuthClient(endpoints: client.endpoints,
                                configuration: OAuthClientConfiguration(clientID: "tokenbroker", clientSecret: Secret("wrong")))
        await #expect(throws: DeviceLoginError.failed(FetchFailure.terminal("client configuration: invalid_client"))) {
            try await other.startDeviceAuthorization()
        }
    }
}
