import Testing
import Upstream
@testable import TokenBrokerDaemon

/// Every trait the daemon asks of a session is its kind's answer (issue 34).
@Suite("Session kinds")
struct SessionKindTests {
    static func kind(_ lines: String) throws -> any SessionKind {
        let configuration = try ConfigLoader.build(INIFile.parse("[Session]\nName=s\n" + lines, file: "f"))
        return SessionFactory.kind(of: try #require(configuration.sessions.first))
    }

    @Test("test, refresh_token and client_credentials sessions: start, logins, revocation at logout, longest flight")
    func traits() throws {
        let test = try Self.kind("Upstream=test\n")
        #expect(test is TestUpstream && test.logsInAtStart && !test.revokesAtLogout && test.longestFlight == .zero && test.parent == nil)
        guard case .none("this session has no OAuth upstream") = test.interactiveLogin else { Issue.record("test offers a login"); return }

        let oauth = "TokenEndpoint=https://as.example/token\nClientID=c\nClientAuthentication=none\nRequestTimeout=7s\n"
        let refresh = try Self.kind(oauth)
        #expect(refresh is RefreshTokenGrant && !refresh.logsInAtStart && refresh.revokesAtLogout && refresh.longestFlight == .seconds(7))
        guard case let .offered(settings) = refresh.interactiveLogin else { Issue.record("refresh_token offers no login"); return }
        #expect(settings.client.clientID == "c")

        let kept = try Self.kind(oauth + "RevokeOnLogout=no\nIssuer=https://as.example\n")
        #expect(!kept.revokesAtLogout && kept.longestFlight == .seconds(7) + Discovery.longest(for: "https://as.example"))

        let machine = try Self.kind(oauth + "Grant=client_credentials\n")
        #expect(machine is ClientCredentialsGrant && machine.logsInAtStart)
        guard case .none("a Grant=client_credentials session needs no login") = machine.interactiveLogin else {
            Issue.record("client_credentials offers a login"); return
        }
    }
}
