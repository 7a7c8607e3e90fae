import Foundation
import Testing
import TestSupport
import TokenBrokerCore
@testable import TokenBrokerDaemon
import DPoP
import Fleet
import Upstream
import HTTPTransport

/// Writes a configuration tree into a temporary directory: the main file and drop-ins.
struct ConfigFixture {
    let directory: String
    var main: String { directory + "/tokenbroker.conf" }

    init(main text: String, dropIns: [String: String] = [:]) throws {
        directory = FileManager.default.temporaryDirectory.appendingPathComponent("tb-config-\(UUID().uuidString.prefix(8))").path
        ScratchDirectories.removeAtExit(directory)
        try FileManager.default.createDirectory(atPath: directory + "/tokenbroker.conf.d", withIntermediateDirectories: true)
        try text.write(toFile: main, atomically: true, encoding: .utf8)
        for (name, content) in dropIns {
            try content.write(toFile: directory + "/tokenbroker.conf.d/" + name, atomically: true, encoding: .utf8)
        }
    }

    func load() throws(ConfigError) -> BrokerConfiguration { try ConfigLoader.load(path: main) }
}

@Suite("Configuration")
struct ConfigTests {
    @Test("clients without a secret: ClientAssertionFile= means private_key_jwt, a drop-in that empties it takes it back; jwt-bearer without ClientID= is no client; the JWKS algorithm and key file rows parse")
    func clientsWithoutSecret() throws {
        let base = "[Session]\nName=a\nTokenEndpoint=https://as.example/t\nClientID=c\nClientAssertionFile=/run/platform/token\n"
        let implied = try ConfigFixture(main: base).load().sessions[0].settings.oauth
        #expect(implied.client.authentication == .privateKeyJWT && implied.client.assertionFile == "/run/platform/token")
        #expect(implied.client.audience(issuer: nil) == .tokenEndpoint)
        let cleared = try ConfigFixture(main: base, dropIns: ["z.conf": "[Session]\nName=a\nClientAssertionFile=\nClientSecret=s\n"]).load()
        #expect(cleared.sessions[0].settings.oauth.client.authentication == .basic)
        #expect(cleared.sessions[0].settings.oauth.client.assertionFile == nil)
        let bearer = try ConfigFixture(main: "[Session]\nName=b\nIssuer=https://as.example\nGrant=jwt-bearer\nAssertionFile=/run/t\n"
                                       + "ClientAssertionAudience=endpoint\nClientAssertionAlgorithm=PS256\n").load().sessions[0].settings.oauth
        #expect(bearer.grant == .jwtBearer && bearer.client.authentication == ClientAuthentication.none && bearer.grantAssertionFile == "/run/t")
        #expect(bearer.client.audience(issuer: bearer.issuer) == .endpoint && bearer.client.assertionAlgorithm == .ps256)
        #expect(SessionConfiguration.OAuthClientSettings().audience(issuer: "https://as.example") == .issuer("https://as.example"))
    }

    @Test("a load takes a session whose lines are the last load's as it was; it reads anew one whose value, line or file changed, or that names a file (its secret may have changed)")
    func sessionsTakenFromTheLastLoad() throws {
        let memo = SessionMemo()
        let plain = "[Session]\nName=plain\nUpstream=test\nTestTokenLifetime=1h\n"
        let fixture = try ConfigFixture(main: plain)
        let secret = fixture.directory + "/secret"
        try "one\n".write(toFile: secret, atomically: true, encoding: .utf8)
        chmod(secret, 0o600)
        let withSecret = "\n[Session]\nName=oauth\nTokenEndpoint=https://as.example/t\nClientID=c\nClientSecretFile=\(secret)\n"
        try (plain + withSecret).write(toFile: fixture.main, atomically: true, encoding: .utf8)
        func load() throws -> BrokerConfiguration { try ConfigLoader.load(path: fixture.main, requireMainFile: true, memo: memo) }

        let first = try load()
        try "two\n".write(toFile: secret, atomically: true, encoding: .utf8)
        chmod(secret, 0o600)
        let second = try load()
        #expect(second.sessions[0].isSame(as: first.sessions[0]), "the same lines: the same session")
        #expect(!second.sessions[1].isSame(as: first.sessions[1]))
        #expect(first.sessions[1].settings.oauth.client.clientSecret == Secret("one"))
        #expect(second.sessions[1].settings.oauth.client.clientSecret == Secret("two"), "a secret file is read at every load")

        // Another value, the same lines one line lower, the same lines in a drop-in: each read anew.
        try (plain.replacingOccurrences(of: "1h", with: "2h") + withSecret).write(toFile: fixture.main, atomically: true, encoding: .utf8)
        let changed = try load()
        #expect(!changed.sessions[0].isSame(as: second.sessions[0]) && changed.sessions[0].settings.testTokenLifetime == .seconds(7200))
        try ("\n" + plain + withSecret).write(toFile: fixture.main, atomically: true, encoding: .utf8)
        let lower = try load()
        #expect(!lower.sessions[0].isSame(as: changed.sessions[0]) && lower.sessions[0].origin == fixture.main + ":2")
        #expect(try load().sessions[0].isSame(as: lower.sessions[0]))
        let dropIn = try ConfigFixture(main: "", dropIns: ["a.conf": "\n" + plain])
        #expect(try !ConfigLoader.load(path: dropIn.main, requireMainFile: true, memo: memo).sessions[0].isSame(as: lower.sessions[0]))

        // A session with an error or a warning is never kept: its next load says it again.
        try (plain + "Frobnicate=1\n").write(toFile: fixture.main, atomically: true, encoding: .utf8)
        let warned = try load()
        #expect(warned.warnings.count == 1)
        let again = try load()
        #expect(again.warnings.count == 1 && !again.sessions[0].isSame(as: warned.sessions[0]))
    }

    @Test("the keys whose value alone decides (SessionMemo.pureKeys) are [Session] keys, and none names a file, a credential, a user or a group")
    func pureKeys() {
        let names = Set(ConfigSchema.session.map(\.name))
        #expect(SessionMemo.pureKeys.isSubset(of: names), "\(SessionMemo.pureKeys.subtracting(names))")
        let reading = names.filter { $0.hasSuffix("File") || $0.hasSuffix("Credential") || $0.hasPrefix("Allow") && !$0.hasSuffix("Resources") && !$0.hasSuffix("Scopes") }
            .union(["CAFile", "ClientCertificate", "ClientKey", "ClientSecret"])
        #expect(reading.isSuperset(of: ["ClientSecretFile", "ClientKeyFile", "AssertionFile", "AllowUsers", "AllowGroups", "ClientKeyCredential"]))
        #expect(SessionMemo.pureKeys.isDisjoint(with: reading), "\(SessionMemo.pureKeys.intersection(reading))")
    }

    @Test("INI: sections, comments, continuation lines, whitespace around '='")
    func ini() throws {
        let sections = try INIFile.parse("""
            # comment
            ; another
            [Broker]
            Socket = /run/x.sock
            [Session]
            Name=api
            AllowUsers=alice \\
              bob
            """, file: "t.conf")
        #expect(sections.map(\.name) == ["Broker", "Session"])
        #expect(sections[0].entries.map(\.value) == ["/run/x.sock"])
        #expect(sections[1].entries.last?.value == "alice bob" && sections[1].entries.last?.line == 7)
    }

    @Test("INI errors carry file:line", arguments: [
        ("Key=1", "t.conf:1: 'Key=' is outside of any [Section]"),
        ("[Broker]\njunk", "t.conf:2: expected 'Key=Value' or '[Section]'"),
        ("[Bro ker]", "t.conf:1: invalid section name 'Bro ker'"),
        ("[Broker\n", "t.conf:1: malformed section header (expected '[Name]')"),
        ("[Broker]\nBad-Key=1", "t.conf:2: invalid key 'Bad-Key'"),
        ("[Broker]\nSocket=/x \\", "t.conf:2: the file ends inside a continued line"),
    ])
    func iniErrors(text: String, message: String) {
        #expect(throws: ConfigError.self) { try INIFile.parse(text, file: "t.conf") }
        do { _ = try INIFile.parse(text, file: "t.conf") } catch { #expect(error.description == message) }
    }

    @Test("main file and drop-ins merge in name order; lists accumulate and an empty value clears")
    func dropIns() throws {
        let fixture = try ConfigFixture(main: """
            [Broker]
            Socket=/run/a.sock
            MaxConnections=100

            [Session]
            Name=api
            Upstream=test
            AllowUsers=0 1
            RefreshAhead=2min
            """, dropIns: [
                "20-later.conf": "[Session]\nName=api\nAllowUsers=\nAllowUsers=7\nRefreshLimitBurst=3\n[Broker]\nMaxConnections=200\n",
                "10-first.conf": "[Session]\nName=api\nAllowUsers=5\nAllowGroups=root 42\n[Session]\nName=other\nUpstream=test\nTestTokenLifetime=90s\n",
                "ignored.txt": "garbage",
            ])
        let configuration = try fixture.load()
        #expect(configuration.socketPath == "/run/a.sock" && configuration.maxConnections == 200)
        #expect(configuration.sessions.map(\.name) == ["api", "other"])
        let api = try #require(configuration.session(named: "api"))
        #expect(api.allowUsers == [7] && api.allowGroups == [0, 42])
        #expect(api.policy.refreshAhead == .seconds(120) && api.policy.guardLimit == 3)
        #expect(configuration.session(named: "other")?.upstream == .test(lifetime: .seconds(90)))
        #expect(configuration.warnings.isEmpty)
    }

    @Test("CRLF line ends read as LF ones (before, \\r\\n was one character and no line ended)")
    func crlf() throws {
        let text = "[Broker]\r\nMaxConnections=7\r\n\r\n# a comment\r\n[Session]\r\nName=api\r\nUpstream=test\r\nRefreshAhead=1min \\\r\n 30s\r\n"
        let configuration = try ConfigLoader.build(INIFile.parse(text, file: "f"))
        #expect(configuration.maxConnections == 7 && configuration.warnings.isEmpty)
        #expect(configuration.sessions.first?.policy.refreshAhead == .seconds(90))
    }

    @Test("unknown keys and sections warn with file:line")
    func warnings() throws {
        let fixture = try ConfigFixture(main: "[Broker]\nColour=blue\n[Extra]\n[Session]\nName=a\nUpstream=test\nFlavour=x\n")
        let warnings = try fixture.load().warnings.map(\.description)
        #expect(warnings == ["\(fixture.main):2: unknown key Colour= in [Broker], ignored",
                             "\(fixture.main):3: unknown section [Extra], ignored",
                             "\(fixture.main):7: unknown key Flavour= in [Session] a, ignored"])
    }

    @Test("bad values fail at file:line", arguments: [
        ("[Broker]\nSocket=relative", 2, "Socket= needs an absolute path"),
        ("[Broker]\nSocketMode=rw", 2, "SocketMode= needs an octal mode such as 0660"),
        ("[Broker]\nMaxConnections=0", 2, "MaxConnections= needs a number from 1 to 1000000"),
        ("[Broker]\nMaxMessageSize=1", 2, "MaxMessageSize= needs a size from 1K to 1M"),
        ("[Broker]\nMaxMessageSize=2M", 2, "MaxMessageSize= needs a size from 1K to 1M"),
        ("[Broker]\nMaxConnectionsPerUser=0", 2, "MaxConnectionsPerUser= needs a number from 1 to 1000000"),
        ("[Broker]\nMessageTimeout=0", 2, "MessageTimeout= needs a time span between 0.1s and 3600s, e.g. 10s"),
        ("[Broker]\nMaxQueuedOutput=1K", 2, "MaxQueuedOutput= needs a size from 64K to 4G"),
        ("[Broker]\nMaxObjectMembers=2", 2, "MaxObjectMembers= needs a number from 16 to 1000000"),
        ("[Broker]\nMetricsListen=10.0.0.1:9464", 2,
         "MetricsListen= needs a loopback address and port (127.0.0.1:9464, [::1]:9464) or an absolute socket path"),
        ("[Broker]\nMetricsListen=127.0.0.1", 2,
         "MetricsListen= needs a loopback address and port (127.0.0.1:9464, [::1]:9464) or an absolute socket path"),
        ("[Broker]\nAdminGroup=no-such-group-xyz", 2, "AdminGroup=: no such group 'no-such-group-xyz'"),
        ("[Broker]\nMetricsGroup=no-such-group-xyz", 2, "MetricsGroup=: no such group 'no-such-group-xyz'"),
        ("[Broker]\nMetricsBearerTokenFile=metrics.token", 2, "MetricsBearerTokenFile= needs an absolute path"),
        ("[Broker]\nMetricsBearerTokenFile=/proc/sys/kernel/ostype", 2,
         "MetricsBearerTokenFile=: /proc/sys/kernel/ostype is readable by every user (mode 0444): refusing a secret in it; "
         + "make it readable by its owner only (chmod 600 /proc/sys/kernel/ostype)"),
        ("[Session]\nUpstream=test", 1, "[Session] needs Name="),
        ("[Session]\nName=a b\nUpstream=test", 2, "invalid session name 'a b' (1-64 of A-Z a-z 0-9 - _ .)"),
        ("[Session]\nName=a", 1, "[Session] a needs ClientID= (or Upstream=test)"),
        ("[Session]\nName=a\nUpstream=https", 3, "Upstream= must be 'oauth' or 'test'"),
        ("[Session]\nName=a\nClientID=c", 1, "[Session] a needs TokenEndpoint= or Issuer="),
        ("[Session]\nName=a\nClientID=c\nTokenEndpoint=https://as.example/token", 1,
         "[Session] a needs ClientSecretFile= or ClientSecretCredential= (or ClientAuthentication=none)"),
        ("[Session]\nName=a\nTokenEndpoint=http://as.example/token", 3,
         "TokenEndpoint=: http:// is allowed only for loopback addresses (127.0.0.0/8, [::1]); use https://"),
        ("[Session]\nName=a\nIssuer=ftp://as.example", 3, "Issuer=: only https:// (or http:// to a loopback address) URLs are allowed"),
        ("[Session]\nName=a\nGrant=password", 3, "Grant= must be refresh_token, client_credentials or jwt-bearer"),
        ("[Session]\nName=a\nClientAuthentication=client_secret_jwt", 3,
         "ClientAuthentication= must be client_secret_basic, client_secret_post, private_key_jwt or none"),
        ("[Session]\nName=a\nClientID=c\nTokenEndpoint=https://as.example/t\nClientAuthentication=private_key_jwt\nClientSecret=s", 6,
         "ClientSecret=: ClientAuthentication=private_key_jwt authenticates with a key, not a secret (leave the secret out: none is needed, "
            + "and none should lie on disk)"),
        ("[Session]\nName=a\nClientID=c\nTokenEndpoint=https://as.example/t\nClientAuthentication=client_secret_post\nClientSecret=s\n"
            + "ClientAssertionFile=/run/token", 5,
         "ClientAuthentication=client_secret_post: ClientAssertionFile= is for ClientAuthentication=private_key_jwt"),
        ("[Session]\nName=a\nClientID=c\nTokenEndpoint=https://as.example/t\nClientAssertionFile=relative", 5,
         "ClientAssertionFile= needs an absolute path"),
        ("[Session]\nName=a\nClientID=c\nTokenEndpoint=https://as.example/t\nClientAuthentication=none\nAssertionFile=/run/token", 6,
         "AssertionFile= is the grant of Grant=jwt-bearer (for client authentication by a platform's JWT, use ClientAssertionFile=)"),
        ("[Session]\nName=a\nTokenEndpoint=https://as.example/t\nGrant=jwt-bearer", 1,
         "[Session] a needs AssertionFile= or AssertionCredential= (the JWT Grant=jwt-bearer presents)"),
        ("[Session]\nName=a\nClientAssertionAlgorithm=HS256", 3, "ClientAssertionAlgorithm= must be auto, ES256, RS256 or PS256"),
        // A JWT-bearer session with a way to authenticate a client needs the client's id.
        ("[Session]\nName=a\nTokenEndpoint=https://as.example/t\nGrant=jwt-bearer\nAssertionFile=/run/grant\nClientAssertionFile=/run/client", 1,
         "[Session] a needs ClientID= (or Upstream=test)"),
        ("[Session]\nName=a\nClientID=c\nTokenEndpoint=https://as.example/t\nClientSecretFile=/nonexistent/secret", 5,
         "ClientSecretFile=: cannot read /nonexistent/secret: open /nonexistent/secret: No such file or directory"),
        ("[Session]\nName=a\nCAFile=relative.pem", 3, "CAFile= needs an absolute path"),
        ("[Session]\nName=a\nUpstream=test\nAllowUsers=nobody-xyz", 4, "AllowUsers=: no such user 'nobody-xyz'"),
        ("[Session]\nName=a\nUpstream=test\nRefreshAhead=soon", 4,
         "RefreshAhead= needs a time span between 0.0s and 86400.0s, e.g. 60s or 5min"),
        ("[Session]\nName=a\nUpstream=test\n[Output]\nSession=a\nPath=/run/t", 4, "[Output] needs Name="),
        ("[Session]\nName=a\nUpstream=test\n[Output]\nName=o\nPath=/run/t", 4, "[Output] o needs Session= (the session whose token it holds)"),
        ("[Session]\nName=a\nUpstream=test\n[Output]\nName=o\nSession=a", 4, "[Output] o needs Path= (where the file is kept)"),
        ("[Session]\nName=a\nUpstream=test\n[Output]\nName=o\nSession=b\nPath=/run/t", 4, "[Output] o: Session= names b, not configured"),
        ("[Session]\nName=a\nUpstream=test\n[Output]\nName=o\nSession=a\nPath=run/t", 7, "Path=: needs an absolute path"),
        ("[Session]\nName=a\nUpstream=test\n[Output]\nName=o\nSession=a\nPath=/run/../t", 7,
         "Path=: names no file (a directory, or a . or .. component)"),
        ("[Session]\nName=a\nUpstream=test\n[Output]\nName=o\nSession=a\nPath=/run/t\nFormat=yaml", 8, "Format= needs token, header or json"),
        ("[Session]\nName=a\nUpstream=test\n[Output]\nName=o\nSession=a\nPath=/run/t\nMode=0755", 8,
         "Mode= needs an octal mode with read bits and its owner's write bit only, such as 0640"),
        ("[Session]\nName=a\nUpstream=test\n[Output]\nName=o\nSession=a\nPath=/run/t\n[Output]\nName=p\nSession=a\nPath=/run/t", 8,
         "[Output] p: Path= is [Output] o's too"),
        ("[Session]\nName=a\nUpstream=test\n[Delegation]\nName=o\nSessions=a\nSocket=/run/s\n[Output]\nName=o\nSession=a\nPath=/run/t", 8,
         "[Output] o: a [Delegation] has this Name= (they share one namespace)"),
        ("[Session]\nName=a\nClientID=c\nTokenEndpoint=https://as.example/t\nClientAuthentication=none\nDPoP=yes\n"
         + "[Output]\nName=o\nSession=a\nPath=/run/t", 7,
         "[Output] o: session a has DPoP tokens, bound to the broker's key: a file cannot carry their proofs"),
    ])
    func badValues(text: String, line: Int, message: String) throws {
        let fixture = try ConfigFixture(main: text)
        do {
            _ = try fixture.load()
            Issue.record("accepted: \(text)")
        } catch {
            // (Among every error of the file, which are all reported.)
            #expect(([error] + error.further).map(\.location).contains("\(fixture.main):\(line): \(message)"), "\(error)")
        }
    }

    /// A fleet configuration's fixture: `@KEY@` stands for a valid key file, `@BADKEY@` for one that is not a key.
    static func fleetFixture(_ text: String) throws -> ConfigFixture {
        let fixture = try ConfigFixture(main: "")
        try SecretFile.write(String(repeating: "ab", count: 32), to: fixture.directory + "/fleet.key")
        try SecretFile.write("short", to: fixture.directory + "/bad.key")
        try SecretFile.write("s3cret", to: fixture.directory + "/secret")
        try text.replacingOccurrences(of: "@KEY@", with: fixture.directory + "/fleet.key")
            .replacingOccurrences(of: "@BADKEY@", with: fixture.directory + "/bad.key")
            .replacingOccurrences(of: "@SECRET@", with: fixture.directory + "/secret")
            .write(toFile: fixture.main, atomically: true, encoding: .utf8)
        return fixture
    }

    static let fleetSession = "[Session]\nName=api\nFleet=yes\nClientID=c\nTokenEndpoint=https://as.example/t\nClientSecretFile=@SECRET@\n"

    @Test("[Fleet] and Fleet=yes: bad values and combinations fail at file:line", arguments: [
        ("[Fleet]\nPrefix=/x", 1, "[Fleet] needs Endpoints= (etcd client URLs)"),
        ("[Fleet]\nEndpoints=http://10.0.0.1:2379", 2,
         "Endpoints=: http:// is allowed only for loopback addresses (127.0.0.0/8, [::1]); use https://"),
        ("[Fleet]\nEndpoints=https://etcd.internal:2379", 1, "[Fleet] needs KeyFile= or KeyCredential= (the fleet key, 32 bytes or 64 hex digits)"),
        ("[Fleet]\nEndpoints=https://e:2379\nKeyFile=@BADKEY@", 3, "KeyFile=: the key must be 32 bytes or 64 hexadecimal digits"),
        ("[Fleet]\nEndpoints=https://e:2379\nKeyFile=@KEY@\nFlightLease=1s", 4,
         "FlightLease= needs a time span between 5.0s and 3600.0s, e.g. 60s or 5min"),
        ("[Fleet]\nPrefix=tokenbroker", 2,
         "Prefix= needs a key prefix such as /tokenbroker (2-128 printable characters, starting with / and not ending with one)"),
        ("[Fleet]\nEndpoints=https://e:2379\nKeyFile=@KEY@\nClientKey=@KEY@", 1, "[Fleet] ClientCertificate= and ClientKey= go together"),
        (fleetSession, 3, "Fleet=yes needs a [Fleet] section with Endpoints= and KeyFile= or KeyCredential="),
        ("[Fleet]\nEndpoints=https://e:2379\nKeyFile=@KEY@\n[Session]\nName=api\nUpstream=test\nFleet=yes", 7,
         "Fleet=yes needs an OAuth session with Grant=refresh_token (a refresh token family is what the fleet shares)"),
        ("[Fleet]\nEndpoints=https://e:2379\nKeyFile=@KEY@\nFlightLease=20s\n" + fleetSession + "RequestTimeout=30s", 7,
         "[Fleet] FlightLease= (20.0s) must be at least the session's RequestTimeout= (30.0s) plus 5s, plus [Fleet] RequestTimeout= for each endpoint (2.0s)"),
        ("[Session]\nName=api\nUpstream=test\nFleet=maybe", 4, "Fleet= must be yes or no"),
        ("[Fleet]\nEndpoints=https://e:2379\nKeyFile=@KEY@\n" + fleetSession + "DPoP=yes", 6,
         "Fleet=yes cannot be used with DPoP=yes (a DPoP key never leaves its host; give each host a session of its own)"),
        ("[Session]\nName=api\nUpstream=test\nDPoP=yes", 4, "DPoP=yes needs Upstream=oauth (the test upstream mints bearer tokens)"),
        ("[Session]\nName=api\nUpstream=test\nDPoP=often", 4, "DPoP= must be yes, no or auto"),
        (fleetSession + "DPoP=auto", 7, "DPoP=auto needs Issuer= (the server's metadata says whether it takes DPoP)"),
    ])
    func fleetErrors(text: String, line: Int, message: String) throws {
        let fixture = try Self.fleetFixture(text)
        do {
            _ = try fixture.load()
            Issue.record("accepted: \(text)")
        } catch {
            #expect(error.description == "\(fixture.main):\(line): \(message)")
        }
    }

    @Test("a fleet: endpoints (trailing slash dropped), prefix, key, lease, member name; only Fleet=yes sessions share it")
    func fleet() throws {
        let fixture = try Self.fleetFixture("[Fleet]\nEndpoints=https://e1:2379/ https://e2:2379\nPrefix=/tb\nKeyFile=@KEY@\nFlightLease=90s\nName=host-a\n"
                                            + Self.fleetSession + "[Session]\nName=local\nUpstream=test\n")
        let configuration = try fixture.load()
        #expect(configuration.warnings.isEmpty)
        let fleet = try #require(configuration.session(named: "api")?.fleet)
        #expect(fleet.endpoints == ["https://e1:2379", "https://e2:2379"] && fleet.prefix == "/tb" && fleet.flightLease == .seconds(90)
                && fleet.member == "host-a" && fleet.key.reveal == Array(String(repeating: "ab", count: 32).utf8))
        #expect(configuration.session(named: "local")?.fleet == nil)
        guard case let .oauth(settings)? = configuration.session(named: "api")?.upstream else { return }
        #expect(settings.dpop == .off, "DPoP= is off unless asked")
    }

    @Test("an OAuth session: endpoints, client, secret from a file (trailing newline dropped), TLS files")
    func oauthSession() throws {
        let fixture = try ConfigFixture(main: "")
        try SecretFile.write("s3cret\n", to: fixture.directory + "/secret")
        try "pem".write(toFile: fixture.directory + "/ca.pem", atomically: true, encoding: .utf8)
        try """
            [Session]
            Name=api
            Issuer=https://as.example
            TokenEndpoint=https://as.example/oauth/token
            ClientID=tokenbroker
            ClientSecretFile=\(fixture.directory)/secret
            ClientAuthentication=client_secret_post
            Scope=read write
            CAFile=\(fixture.directory)/ca.pem
            RequestTimeout=10s
            RevokeOnLogout=no
            """.write(toFile: fixture.main, atomically: true, encoding: .utf8)
        let configuration = try fixture.load()
        guard case let .oauth(settings)? = configuration.session(named: "api")?.upstream else {
            Issue.record("not an OAuth session")
            return
        }
        #expect(settings.grant == .refreshToken && settings.issuer == "https://as.example" && !settings.revokeOnLogout)
        #expect(settings.endpoints?.token == "https://as.example/oauth/token")
        #expect(settings.client.clientID == "tokenbroker" && settings.client.clientSecret == Secret("s3cret"))
        #expect(settings.client.authentication == .post && settings.client.scope == "read write")
        #expect(settings.client.tls.caFile == fixture.directory + "/ca.pem" && settings.client.timeout == .seconds(10))
        #expect(configuration.warnings.isEmpty)
    }

    @Test("a client secret in the configuration itself works but warns loudly")
    func inlineSecret() throws {
        let fixture = try ConfigFixture(main: "[Session]\nName=api\nTokenEndpoint=http://127.0.0.1:9/token\nClientID=c\nClientSecret=oops\n")
        let configuration = try fixture.load()
        #expect(configuration.warnings.count == 1)
        #expect(configuration.warnings.first?.description.contains("ClientSecret= puts a secret in a configuration file") == true)
        #expect(configuration.warnings.first?.description.contains("oops") == false)
    }

    /// Every key that names a file holding a secret, with the configuration around it: `@FILE@`
    /// stands for the secret file, `@CERT@` for a certificate, `@KEY@` for a valid fleet key.
    static let secretFileKeys: [(key: String, content: String, text: String)] = [
        ("ClientSecretFile", "s3cret\n", "[Session]\nName=a\nClientID=c\nTokenEndpoint=https://as.example/t\nClientSecretFile=@FILE@\n"),
        ("StateKeyFile", String(repeating: "ab", count: 32), "[Broker]\nStateKeyFile=@FILE@\n"),
        ("MetricsBearerTokenFile", "metrics-test-bearer-0123456789abcdef\n", "[Broker]\nMetricsBearerTokenFile=@FILE@\n"),
        ("ClientKey", "key", "[Session]\nName=a\nUpstream=test\nClientCertificate=@CERT@\nClientKey=@FILE@\n"),
        ("KeyFile", String(repeating: "cd", count: 32), "[Fleet]\nEndpoints=https://e:2379\nKeyFile=@FILE@\n"),
        ("ClientKey", "key", "[Fleet]\nEndpoints=https://e:2379\nKeyFile=@KEY@\nClientCertificate=@CERT@\nClientKey=@FILE@\n"),
    ]

    @Test("a secret file every user may read is refused at file:line, naming the file and its mode; one its group may read warns, naming the group",
          arguments: secretFileKeys.indices)
    func secretFileModes(index: Int) throws {
        let (key, content, text) = Self.secretFileKeys[index]
        let fixture = try ConfigFixture(main: "")
        let file = fixture.directory + "/secret"
        try SecretFile.write(content, to: file)
        try SecretFile.write(String(repeating: "ef", count: 32), to: fixture.directory + "/fleet.key")
        try "pem".write(toFile: fixture.directory + "/cert.pem", atomically: true, encoding: .utf8)
        let configured = text.replacingOccurrences(of: "@FILE@", with: file).replacingOccurrences(of: "@CERT@", with: fixture.directory + "/cert.pem")
            .replacingOccurrences(of: "@KEY@", with: fixture.directory + "/fleet.key")
        try configured.write(toFile: fixture.main, atomically: true, encoding: .utf8)
        let line = configured.split(separator: "\n").firstIndex { $0.hasPrefix(key + "=") }.map { $0 + 1 } ?? 0
        let group = try #require(getgrgid(getegid())).pointee.gr_name.map { String(cString: $0) } ?? "?"
        chown(file, geteuid(), getegid())

        #expect(try fixture.load().warnings.isEmpty, "\(key)= 0600")
        for mode in [0o620, 0o602, 0o400] as [mode_t] {
            chmod(file, mode)
            #expect(try fixture.load().warnings.isEmpty, "\(key)= \(String(mode, radix: 8))")
        }
        chmod(file, 0o640)
        #expect(try fixture.load().warnings.map(\.description) == [
            "\(fixture.main):\(line): \(key)=: \(file) is readable by group \(group) (mode 0640): every member can read the secret; "
            + "chmod 600 \(file) unless that is meant",
        ])
        for mode in [0o644, 0o604, 0o4644] as [mode_t] {
            chmod(file, mode)
            do {
                _ = try fixture.load()
                Issue.record("\(key)= accepted with mode \(String(mode, radix: 8))")
            } catch {
                #expect(error.description == "\(fixture.main):\(line): \(key)=: \(file) is readable by every user (mode \(SecretFileAccess.octal(mode))): "
                        + "refusing a secret in it; make it readable by its owner only (chmod 600 \(file))")
            }
        }
    }

    @Test("a bearer token file of the wrong shape is refused (0600: its content is what is wrong)")
    func bearerTokenShape() throws {
        let fixture = try ConfigFixture(main: "")
        try SecretFile.write("short\n", to: fixture.directory + "/token")
        try "[Broker]\nMetricsBearerTokenFile=\(fixture.directory)/token\n".write(toFile: fixture.main, atomically: true, encoding: .utf8)
        #expect(throws: ConfigError(file: fixture.main, line: 2,
                                    "MetricsBearerTokenFile=: the token must be 16 to 4096 visible ASCII characters (e.g. openssl rand -hex 32)")) {
            try fixture.load()
        }
    }

    @Test("a missing main file is an error when named, defaults otherwise")
    func missingFile() throws {
        #expect(throws: ConfigError.self) { try ConfigLoader.load(path: "/nonexistent/tokenbroker.conf") }
        let defaults = try ConfigLoader.load(path: "/nonexistent/tokenbroker.conf", requireMainFile: false)
        #expect(defaults.socketPath == BrokerConfiguration.defaultSocket && defaults.sessions.isEmpty)
    }

    @Test("durations and sizes")
    func values() {
        #expect(ConfigValue.duration("90") == .seconds(90))
        #expect(ConfigValue.duration("1h 30min") == .seconds(5400))
        #expect(ConfigValue.duration("250ms") == .milliseconds(250))
        #expect(ConfigValue.duration("2 d") == .seconds(172_800))
        #expect(ConfigValue.duration("5 parsecs") == nil)
        #expect(ConfigValue.duration("") == nil)
        #expect(ConfigValue.size("64K") == 65_536 && ConfigValue.size("1M") == 1 << 20 && ConfigValue.size("x") == nil)
        #expect(ConfigValue.mode("0660") == 0o660 && ConfigValue.mode("999") == nil)
    }
}

@Suite("Shipped configuration files")
struct ShippedConfigTests {
    static let root = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent()

    @Test("config/tokenbroker.conf with its example drop-in, and config/dev.conf, load without warnings")
    func shipped() throws {
        let documented = try ConfigLoader.load(path: Self.root.appendingPathComponent("config/tokenbroker.conf").path)
        #expect(documented.warnings.isEmpty && documented == {
            var defaults = BrokerConfiguration()
            defaults.sessions = documented.sessions
            return defaults
        }())
        let example = try #require(documented.session(named: "example"))
        #expect(example.policy == RefreshPolicy() && example.upstream == .test(lifetime: .seconds(3600)))
        let dev = try ConfigLoader.load(path: Self.root.appendingPathComponent("config/dev.conf").path)
        #expect(dev.warnings.isEmpty && dev.session(named: "demo") != nil)
    }

    @Test("a raw 32-byte key file (bytes that are no text) is kept as its bytes (issue 34)")
    func rawKeyBytes() throws {
        let fixture = try ConfigFixture(main: "")
        let raw = (0..<32).map { UInt8(0xE0 + $0 % 32) }   // not UTF-8
        let path = fixture.directory + "/state.key"
        #expect(FileManager.default.createFile(atPath: path, contents: Data(raw), attributes: [.posixPermissions: 0o600]))
        try "[Broker]\nStateKeyFile=\(path)\n[Session]\nName=a\nUpstream=test\n".write(toFile: fixture.main, atomically: true, encoding: .utf8)
        let key = try #require(try fixture.load().stateKey)
        #expect(key.reveal == raw)
        #expect("\(key)" == "<redacted>")
    }
}
