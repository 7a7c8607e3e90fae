import DevIssuer
import Foundation
import Testing
import TestSupport
import Varlink

/// The authorization code login with PKCE through the real daemon, against the development
/// issuer: the daemon's loopback listener, the pasted redirect, and each way a login fails.
/// The browser is played by raw HTTP: a GET of the authorization URL whose `Location` is read,
/// then a GET of that at the listener (or the URL pasted). No code or token is printed: codes
/// live only in the redirect URLs, which are never part of a message.
@Suite("Code login (authorization code + PKCE) through the daemon", .serialized)
struct CodeLoginTests {
    /// Session `web`: explicit endpoints, no device endpoint (LoginFlow=auto picks code);
    /// session `api`: discovery, which lists a device endpoint (auto picks device).
    static func config(_ issuer: DevIssuer, timeout: String = "5min", ports: String = "", scope: String = "openid profile") -> String {
        """
        [Broker]
        SocketMode=0666

        [Session]
        Name=web
        TokenEndpoint=\(issuer.tokenEndpoint)
        RevocationEndpoint=\(issuer.revocationEndpoint)
        AuthorizationEndpoint=\(issuer.authorizationEndpoint)
        ClientID=tokenbroker
        ClientSecretFile=@DIR@/client-secret
        Scope=\(scope)
        RequestTimeout=5s
        LoginTimeout=\(timeout)
        LoginRedirectPorts=\(ports)

        [Session]
        Name=api
        Issuer=\(issuer.baseURL)
        ClientID=tokenbroker
        ClientSecretFile=@DIR@/client-secret

        """
    }

    static func withIssuerAndBroker(timeout: String = "5min", ports: String = "", scope: String = "openid profile",
                                    _ configure: (inout DevIssuer.Options) -> Void = { _ in },
                                    _ body: (DevIssuer, Broker) async throws -> Void) async throws {
        var options = DevIssuer.Options()
        configure(&options)
        let issuer = try DevIssuer(options: options)
        defer { issuer.stop() }
        try await withBroker(config: Self.config(issuer, timeout: timeout, ports: ports, scope: scope)) { broker in
            try await body(issuer, broker)
        }
    }

    /// One HTTP/1.1 GET to 127.0.0.1:`port`: status, headers (names lower-cased), body; nil when nothing answers.
    static func get(_ port: Int, _ target: String, method: String = "GET") -> (status: Int, headers: [String: String], body: String)? {
        raw(port, "\(method) \(target) HTTP/1.1\r\nHost: 127.0.0.1:\(port)\r\nConnection: close\r\n\r\n")
    }

    /// Sends `request` as it is, and reads the answer to its end (5 s at most).
    static func raw(_ port: Int, _ request: String) -> (status: Int, headers: [String: String], body: String)? {
        let fd = LoopbackTCP.connect(port)
        guard fd >= 0 else { return nil }
        defer { close(fd) }
        var timeout = timeval(tv_sec: 5, tv_usec: 0)
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, socklen_t(MemoryLayout<timeval>.size))
        _ = Array(request.utf8).withUnsafeBytes { send(fd, $0.baseAddress, $0.count, Int32(MSG_NOSIGNAL)) }
        var answer: [UInt8] = []
        var buffer = [UInt8](repeating: 0, count: 65_536)
        while case let count = read(fd, &buffer, buffer.count), count > 0 { answer += buffer[..<count] }
        let text = String(decoding: answer, as: UTF8.self)
        guard let split = text.range(of: "\r\n\r\n") else { return nil }
        let lines = text[..<split.lowerBound].split(separator: "\r\n")
        guard let status = lines.first?.split(separator: " ").dropFirst().first.flatMap({ Int($0) }) else { return nil }
        var headers: [String: String] = [:]
        for line in lines.dropFirst() {
            guard let colon = line.firstIndex(of: ":") else { continue }
            headers[line[..<colon].lowercased()] = line[line.index(after: colon)...].trimmingCharacters(in: .whitespaces)
        }
        return (status, headers, String(text[split.upperBound...]))
    }

    /// A redirect URL the issuer sent the browser: it carries a code, so it prints as a
    /// fingerprint, and so does its request-target (a test's failure message shows neither).
    struct Redirect: Sendable, CustomStringConvertible {
        let url: String
        var description: String { "a redirect (\(fp(url)))" }

        /// What the browser sends the listener: the path and query.
        var target: Target {
            let afterScheme = url.dropFirst("http://".count)
            return Target(text: String(afterScheme[(afterScheme.firstIndex(of: "/") ?? afterScheme.endIndex)...]))
        }

        func replacingOccurrences(of old: String, with new: String) -> Redirect {
            Redirect(url: url.replacingOccurrences(of: old, with: new))
        }
    }

    struct Target: Sendable, CustomStringConvertible {
        let text: String
        var description: String { "a request-target (\(fp(text)))" }
    }

    static func get(_ port: Int, _ target: Target) -> (status: Int, headers: [String: String], body: String)? {
        get(port, target.text)
    }

    /// What a browser does with the authorization URL: the redirect it is sent (not followed).
    static func authorize(_ issuer: DevIssuer, _ url: String) throws -> Redirect {
        #expect(url.hasPrefix(issuer.authorizationEndpoint + "?"))
        let answer = try #require(get(Int(issuer.port), String(url.dropFirst(issuer.baseURL.utf8.count))), "the issuer answers")
        #expect(answer.status == 302, "the authorization endpoint redirects (HTTP \(answer.status))")
        return Redirect(url: try #require(answer.headers["location"], "a Location"))
    }

    /// The listener's port and path in a redirect URI.
    static func port(of uri: String) -> Int? {
        guard uri.hasPrefix("http://127.0.0.1:") else { return nil }
        return Int(uri.dropFirst("http://127.0.0.1:".count).prefix(while: \.isNumber))
    }

    /// A CodeLogin call and its prompt, on a connection the caller keeps for the final reply.
    static func begin(_ broker: Broker, _ session: String = "web", refusals: Bool = false) throws -> (client: VarlinkClient, authorizationUri: String, redirectUri: String) {
        let client = try broker.client(timeout: 30)
        let prompt = try client.call("io.tokenbroker.Broker.CodeLogin", refusals ? ["session": .string(session), "refusals": true] : ["session": .string(session)],
                                     more: true)
        #expect(prompt.error == nil && prompt.continues, "\(prompt)")
        #expect(prompt.parameters["event"] == "prompt")
        return (client, prompt.parameters["authorizationUri"]?.stringValue ?? "", prompt.parameters["redirectUri"]?.stringValue ?? "")
    }

    static func loginFailed(_ reply: VarlinkReply, _ session: String = "web") -> String? {
        guard reply.error == "io.tokenbroker.Broker.LoginFailed", reply.parameters["session"] == .string(session) else { return nil }
        return reply.parameters["reason"]?.stringValue
    }

    // MARK: - Through ctl

    @Test("ctl login (auto picks the code flow: no device endpoint): the browser's redirect reaches the daemon's listener, the page says logged in, ctl exits 0, the session serves the code's token, and the listener is closed")
    func listener() async throws {
        try await Self.withIssuerAndBroker { issuer, broker in
            let login = try Child(Paths.tokenbroker, ["ctl", "--socket", broker.socket, "login", "web"], directory: broker.directory, pipeInput: true)
            try await eventually("the prompt") { login.stdout.contains("Waiting for the login") || !login.process.isRunning }
            let out = login.stdout
            // Which flow and why first; the URL last, just above the wait (issue 33).
            #expect(out.hasPrefix("Logging in 'web' with the authorization code flow (PKCE): LoginFlow=auto, and the server has no device authorization "
                                  + "endpoint (configured).\nThe browser comes back to "), "\(out)")
            #expect(out.contains("\nTo log in 'web', open this address in a browser:\n\n  \(issuer.authorizationEndpoint)?"), "\(login.stderr)")
            #expect(out.split(separator: "\n").suffix(2).first?.hasPrefix("  \(issuer.authorizationEndpoint)?") == true, "\(out)")
            let url = try #require(out.split(separator: "\n").first { $0.hasPrefix("  http") }.map { String($0.dropFirst(2)) })
            let redirectURI = try #require(out.firstRange(of: "The browser comes back to ").map { String(out[$0.upperBound...].prefix { $0 != " " }) })
            let port = try #require(Self.port(of: redirectURI))
            #expect(redirectURI == "http://127.0.0.1:\(port)/callback")
            #expect(out.contains("  ssh -L \(port):127.0.0.1:\(port) "))
            #expect(out.contains("Waiting for the login (up to 5 min)…"))
            // No QR code: stdout is not a terminal.
            #expect(!out.contains("█"))

            let redirect = try Self.authorize(issuer, url)
            let toListener = redirect.url.hasPrefix(redirectURI + "?")
            #expect(toListener)
            let page = try #require(Self.get(port, redirect.target), "the listener answers")
            #expect(page.status == 200 && page.body.contains("web is logged in (generation 1)"), "HTTP \(page.status)")
            #expect(page.headers["content-security-policy"] == "default-src 'none'" && page.headers["cache-control"] == "no-store")
            #expect(await login.wait() == 0, "\(login.stderr)")
            #expect(login.stdout.hasSuffix("logged in web (generation 1)\n"))
            #expect(issuer.counters.codeGrants == 1 && issuer.counters.refreshGrants == 0)
            let token = try #require(try broker.call("GetToken", ["session": "web"]).parameters["token"]?.stringValue)
            #expect(issuer.isValidAccessToken(token))
            try await eventually("the listener is closed") { LoopbackTCP.connect(port).closing() < 0 }
        }
    }

    @Test("ctl login with the redirect pasted on stdin: a line that is not the login's answer is refused with why, and the login goes on waiting; the login's own redirect logs the session in")
    func paste() async throws {
        try await Self.withIssuerAndBroker { issuer, broker in
            let login = try Child(Paths.tokenbroker, ["ctl", "--socket", broker.socket, "login", "web", "--flow=code"], directory: broker.directory,
                                  pipeInput: true)
            try await eventually("the prompt") { login.stdout.contains("Waiting for the login") || !login.process.isRunning }
            let url = try #require(login.stdout.split(separator: "\n").first { $0.hasPrefix("  http") }.map { String($0.dropFirst(2)) })
            let redirect = try Self.authorize(issuer, url)
            login.write(toInput: "not an address\n")
            try await eventually("the hint") { login.stderr.contains("paste the whole address") }
            login.write(toInput: redirect.replacingOccurrences(of: "state=", with: "state=x").url + "\n")
            try await eventually("the state refusal") { login.stderr.contains("Not taken: the redirect's state is not the login's. The login is still waiting.\n") }
            #expect(login.process.isRunning)
            // A paste not taken is no failure: the login waits on (issue 33).
            #expect(!login.stderr.contains("failed") && !login.stderr.contains("Error"), "\(login.stderr)")
            login.write(toInput: "  " + redirect.url + "  \n")
            #expect(await login.wait() == 0, "\(login.stderr)")
            #expect(login.stdout.hasSuffix("logged in web (generation 1)\n"))
            #expect(!login.stderr.contains("code="), "no redirect is echoed")
            #expect(issuer.counters.codeGrants == 1)
        }
    }

    @Test("LoginFlow: code where the server has no device endpoint, device where discovery lists one; ctl login --flow=device forces the device flow")
    func flows() async throws {
        try await Self.withIssuerAndBroker { _, broker in
            #expect(try broker.call("LoginFlow", ["session": "web"]).parameters
                    == ["flow": "code", "reason": "LoginFlow=auto, and the server has no device authorization endpoint (configured)"])
            #expect(try broker.call("LoginFlow", ["session": "api"]).parameters
                    == ["flow": "device", "reason": "LoginFlow=auto, and the server has a device authorization endpoint (configured or in its metadata)"])
            let bad = try await broker.ctl(["login", "web", "--flow=browser"])
            #expect(bad.code == 64 && bad.err.hasPrefix("Error: --flow needs code or device\n"))
            let both = try await broker.ctl(["login", "web", "--flow=code", "--refresh-token-stdin"])
            #expect(both.code == 64)
            // Admins only: CodeLogin, and LoginFlow when ctl asks which flow.
            let denied = try await broker.ctl(["login", "web", "--flow=code"], asUser: 65534)
            #expect(denied.code == 77 && denied.err.contains("permission denied: this user may not call CodeLogin"), "\(denied.err)")
            let asked = try await broker.ctl(["login", "web"], asUser: 65534)
            #expect(asked.code == 77 && asked.err.contains("permission denied: this user may not call LoginFlow"), "\(asked.err)")
        }
    }

    // MARK: - Failures, each changing nothing

    @Test("the server's error= redirect ends the login with its words; the session stays signed out")
    func denied() async throws {
        try await Self.withIssuerAndBroker({ $0.consent = .deny }) { issuer, broker in
            let (client, url, redirectURI) = try Self.begin(broker)
            let redirect = try Self.authorize(issuer, url)
            let port = try #require(Self.port(of: redirectURI))
            let page = try #require(Self.get(port, redirect.target))
            #expect(page.status == 403 && page.body.contains("access_denied"))
            let end = try client.nextReply()
            #expect(Self.loginFailed(end) == "the authorization server refused: access_denied (The user denied the request.)")
            #expect(try broker.call("GetToken", ["session": "web"]).error == "io.tokenbroker.Broker.SignedOut")
            #expect(issuer.counters.codeGrants == 0)
        }
    }

    @Test("a redirect whose state is not the login's is a 400 at the listener and changes nothing; the listener serves nothing but GET /callback")
    func wrongStateAndOtherPaths() async throws {
        try await Self.withIssuerAndBroker { issuer, broker in
            let (client, url, redirectURI) = try Self.begin(broker)
            let port = try #require(Self.port(of: redirectURI))
            issuer.inject([.wrongState])
            let forged = try Self.authorize(issuer, url)
            let refused = try #require(Self.get(port, forged.target))
            #expect(refused.status == 400 && refused.body.contains("state is not the login") && refused.body.contains("still waiting"))
            #expect(Self.get(port, "/")?.status == 404)
            #expect(Self.get(port, "/callback/x?code=a&state=b")?.status == 404)
            #expect(Self.get(port, "/callback", method: "POST")?.status == 405)
            #expect(Self.raw(port, "garbage\r\n\r\n")?.status == 400)
            // Only a navigation to the redirect URI itself: not under another Host (a DNS
            // rebinding page), nor a page's fetch of it; and refused pages name no session.
            let own = try Self.authorize(issuer, url)
            let rebound = Self.raw(port, "GET \(own.target.text) HTTP/1.1\r\nHost: attacker.example:\(port)\r\n\r\n")
            #expect(rebound?.status == 400 && rebound?.body.contains("Wrong host") == true && rebound?.body.contains("web") == false)
            let fetched = Self.raw(port, "GET \(own.target.text) HTTP/1.1\r\nHost: 127.0.0.1:\(port)\r\nSec-Fetch-Mode: no-cors\r\n\r\n")
            #expect(fetched?.status == 403)
            #expect(Self.raw(port, "GET / HTTP/1.1\r\n\r\n")?.status == 400, "no Host at all")
            // Pasted, a redirect to a port nobody listens on is refused as well, saying why.
            let elsewhere = own.replacingOccurrences(of: ":\(port)/", with: ":\(port == 65535 ? 65534 : port + 1)/")
            let pasted = try broker.call("CompleteCodeLogin", ["session": "web", "redirectUrl": .string(elsewhere.url)])
            #expect(Self.loginFailed(pasted) == "the redirect is not to the login's redirect URI; the login is still waiting")
            // The login still waits: its own redirect ends it.
            let page = try #require(Self.get(port, (try Self.authorize(issuer, url)).target))
            #expect(page.status == 200)
            #expect(try client.nextReply().parameters == ["event": "done", "generation": 1])
        }
    }

    @Test("a replayed code: redeemed once by the daemon; a second listener request or paste is refused; an old code under a new login's state is refused by the server and the session keeps its generation")
    func replayedCode() async throws {
        try await Self.withIssuerAndBroker { issuer, broker in
            let first = try Self.begin(broker)
            let redirect = try Self.authorize(issuer, first.authorizationUri)
            #expect(Self.get(try #require(Self.port(of: first.redirectUri)), redirect.target)?.status == 200)
            #expect(try first.client.nextReply().parameters["generation"] == 1)
            // Pasted again: no login waits.
            let again = try broker.call("CompleteCodeLogin", ["session": "web", "redirectUrl": .string(redirect.url)])
            #expect(Self.loginFailed(again)?.hasPrefix("no code login of this session is waiting") == true)

            // The spent code carried into a new login (with that login's state): redeemed, refused.
            let second = try Self.begin(broker)
            let state = try #require(second.authorizationUri.firstRange(of: "state=").map { second.authorizationUri[$0.upperBound...].prefix { $0 != "&" } })
            let spent = redirect.url.firstRange(of: "code=").map { redirect.url[$0.upperBound...].prefix { $0 != "&" } }
            let code = try #require(spent, "the redirect has a code")
            let carried = second.redirectUri + "?code=\(code)&state=\(state)"
            let answer = try broker.call("CompleteCodeLogin", ["session": "web", "redirectUrl": .string(carried)])
            #expect(Self.loginFailed(answer)?.hasPrefix("the code was not redeemed: invalid_grant") == true, "\(answer.error ?? "")")
            #expect(Self.loginFailed(try second.client.nextReply())?.hasPrefix("the code was not redeemed: invalid_grant") == true)
            #expect(issuer.counters.codeReplays == 1 && issuer.counters.codeGrants == 2, "two redemptions, the second of a spent code")
            #expect(try broker.status("web")?["generation"] == 1)
            let secondPort = try #require(Self.port(of: second.redirectUri))
            try await eventually("the second listener is closed") { LoopbackTCP.connect(secondPort).closing() < 0 }
        }
    }

    @Test("a logout while the login waits: the login's tokens are not installed and their refresh token is revoked; a reload that changes the session does the same")
    func boundaries() async throws {
        try await Self.withIssuerAndBroker { issuer, broker in
            // Logged in once, so that the logout is a boundary between two generations.
            let first = try Self.begin(broker)
            #expect(Self.get(Self.port(of: first.redirectUri)!, (try Self.authorize(issuer, first.authorizationUri)).target)?.status == 200)
            #expect(try first.client.nextReply().parameters["generation"] == 1)

            let login = try Self.begin(broker)
            let redirect = try Self.authorize(issuer, login.authorizationUri)
            #expect(try broker.call("Logout", ["session": "web"]).error == nil)
            let revocationsBefore = issuer.counters.revocations
            let answer = try broker.call("CompleteCodeLogin", ["session": "web", "redirectUrl": .string(redirect.url)])
            #expect(Self.loginFailed(answer)?.hasPrefix("the session was logged out or logged in again while this login waited") == true,
                    "\(answer.error ?? "")")
            #expect(Self.loginFailed(try login.client.nextReply()) != nil)
            #expect(try broker.call("GetToken", ["session": "web"]).error == "io.tokenbroker.Broker.SignedOut")
            try await eventually("the refused login's refresh token is revoked") { issuer.counters.revocations > revocationsBefore }
            #expect(issuer.counters.codeGrants == 2)
        }
        // A reload that rebuilds the session while its login waits.
        try await Self.withIssuerAndBroker { issuer, broker in
            let login = try Self.begin(broker)
            let redirect = try Self.authorize(issuer, login.authorizationUri)
            try String(Self.config(issuer).replacingOccurrences(of: "RequestTimeout=5s", with: "RequestTimeout=6s")
                .replacingOccurrences(of: "@DIR@", with: broker.directory)).write(toFile: broker.configPath, atomically: true, encoding: .utf8)
            #expect(try broker.call("Reload").error == nil)
            let answer = try broker.call("CompleteCodeLogin", ["session": "web", "redirectUrl": .string(redirect.url)])
            #expect(Self.loginFailed(answer) == "the session was reconfigured during the login; log in again", "\(answer.error ?? "")")
            #expect(try broker.call("GetToken", ["session": "web"]).error == "io.tokenbroker.Broker.SignedOut")
            try await eventually("its refresh token is revoked") { issuer.counters.revocations == 1 }
        }
    }

    @Test("a session with Issuer=: the redirect's iss must be that issuer (RFC 9207, which the dev issuer's metadata promises): another's, or none, is a 400 and the login goes on; its own logs in")
    func issuerChecked() async throws {
        try await Self.withIssuerAndBroker { issuer, broker in
            let login = try Self.begin(broker, "api")
            let port = try #require(Self.port(of: login.redirectUri))
            let redirect = try Self.authorize(issuer, login.authorizationUri)
            // (Booleans only: the redirect carries the code.)
            let iss = redirect.url.firstRange(of: "&iss=").map { "&" + redirect.url[redirect.url.index(after: $0.lowerBound)...].prefix { $0 != "&" } }
            let ownIssuer = try #require(iss, "the dev issuer sends iss")
            let mixedUp = Self.get(port, (redirect.replacingOccurrences(of: ownIssuer, with: "&iss=https%3A%2F%2Fevil.example")).target)
            #expect(mixedUp?.status == 400 && mixedUp?.body.contains("another issuer") == true)
            let withoutIss = Self.get(port, (redirect.replacingOccurrences(of: ownIssuer, with: "")).target)
            #expect(withoutIss?.status == 400 && withoutIss?.body.contains("no iss") == true)
            #expect(Self.get(port, redirect.target)?.status == 200)
            #expect(try login.client.nextReply().parameters == ["event": "done", "generation": 1])
            // Not only the browser hears of a refusal: the journal says each (issue 32: a server
            // that sends no iss left the user waiting for LoginTimeout=).
            try await eventually("the journal says the refusals") {
                broker.child.stderr.contains("code login of session api: the redirect listener refused a request: a redirect that is not this login's answer: the redirect's iss names another issuer")
                    && broker.child.stderr.contains("code login of session api: the redirect listener refused a request: a redirect that is not this login's answer: the redirect has no iss")
            }
        }
    }

    @Test("a caller that asks (refusals: true) hears each request the listener refuses as a refused event, bounded per login (requests anyone can send apart from redirects that carry the login's state), before the done; one that does not hears none; ctl login prints each on stderr (issue 32)")
    func refusalsTold() async throws {
        try await Self.withIssuerAndBroker { issuer, broker in
            let login = try Self.begin(broker, refusals: true)
            let port = try #require(Self.port(of: login.redirectUri))
            let redirect = try Self.authorize(issuer, login.authorizationUri)
            // Another state, another Host, a fetch, a POST: each told; another path is not.
            #expect(Self.get(port, redirect.replacingOccurrences(of: "state=", with: "state=x").target)?.status == 400)
            #expect(Self.raw(port, "GET \(redirect.target.text) HTTP/1.1\r\nHost: localhost:\(port)\r\n\r\n")?.status == 400)
            #expect(Self.raw(port, "GET \(redirect.target.text) HTTP/1.1\r\nHost: 127.0.0.1:\(port)\r\nSec-Fetch-Mode: cors\r\n\r\n")?.status == 403)
            #expect(Self.get(port, "/callback", method: "POST")?.status == 405)
            #expect(Self.get(port, "/favicon.ico")?.status == 404)
            var told: [String] = []
            for _ in 0..<4 {
                let event = try login.client.nextReply()
                guard event.parameters["event"] == "refused", let reason = event.parameters["reason"]?.stringValue else {
                    Issue.record("not a refusal: \(event)")
                    break
                }
                told.append(reason)
            }
            #expect(told == ["a redirect that is not this login's answer: the redirect's state is not the login's",
                             "a request for Host localhost:\(port), not 127.0.0.1:\(port) (the redirect URI's host and port, exactly)",
                             "a request that was not a browser's navigation (Sec-Fetch-Mode: cors)",
                             "a POST request (the redirect is a GET)"])
            // No code is in a refusal; at most 10 requests anyone could send are told, then one
            // line says more were not; a redirect with the login's state is told all the same.
            let code = redirect.url.firstRange(of: "code=").map { redirect.url[$0.upperBound...].prefix { $0 != "&" } } ?? ""
            let leaked = told.contains { !code.isEmpty && $0.contains(code) }
            #expect(!leaked)
            for _ in 0..<30 { _ = Self.get(port, "/callback?state=nothing") }
            var more = 0
            while true {
                let event = try login.client.nextReply()
                guard event.parameters["event"] == "refused" else {
                    Issue.record("the login ended: \(event)")
                    break
                }
                more += 1
                if event.parameters["reason"] == "more requests were refused; they are not told one by one" { break }
            }
            #expect(more == 7, "refusals told after the first four: \(more)")
            #expect(Self.get(port, redirect.replacingOccurrences(of: "code=", with: "xcode=").target)?.status == 400)
            let answer = try login.client.nextReply()
            #expect(answer.parameters["event"] == "refused" && answer.parameters["reason"] == "a redirect that is not this login's answer: the redirect has no code")
            #expect(Self.get(port, redirect.target)?.status == 200)
            #expect(try login.client.nextReply().parameters == ["event": "done", "generation": 1])
        }
        try await Self.withIssuerAndBroker { issuer, broker in
            let login = try Child(Paths.tokenbroker, ["ctl", "--socket", broker.socket, "login", "web"], directory: broker.directory, pipeInput: true)
            try await eventually("the prompt") { login.stdout.contains("Waiting for the login") || !login.process.isRunning }
            let url = try #require(login.stdout.split(separator: "\n").first { $0.hasPrefix("  http") }.map { String($0.dropFirst(2)) })
            issuer.inject([.wrongState])
            let forged = try Self.authorize(issuer, url)
            let port = try #require(Self.port(of: String(forged.url.prefix { $0 != "?" })))
            #expect(Self.get(port, forged.target)?.status == 400)
            try await eventually("ctl says the refusal") {
                login.stderr.contains("The listener refused a redirect that is not this login's answer: the redirect's state is not the login's; the login is still waiting.")
            }
            #expect(login.process.isRunning)
            #expect(Self.get(port, try Self.authorize(issuer, url).target)?.status == 200)
            #expect(await login.wait() == 0, "\(login.stderr)")
        }
    }

    @Test("one code login per session at a time; the caller leaving abandons it and closes its listener")
    func oneAtATime() async throws {
        try await Self.withIssuerAndBroker { _, broker in
            var login: (client: VarlinkClient, authorizationUri: String, redirectUri: String)? = try Self.begin(broker)
            let second = try broker.client().call("io.tokenbroker.Broker.CodeLogin", ["session": "web"], more: true)
            #expect(Self.loginFailed(second)?.hasPrefix("a login of this session is under way already") == true)
            // A device login shares the slot.
            let device = try broker.client().call("io.tokenbroker.Broker.DeviceLogin", ["session": "web"], more: true)
            #expect(Self.loginFailed(device)?.hasPrefix("a login of this session is under way already") == true)
            let port = try #require(Self.port(of: login?.redirectUri ?? ""))
            login = nil   // the connection closes
            #expect(login == nil)
            try await eventually("the listener is closed") { LoopbackTCP.connect(port).closing() < 0 }
            try await eventually("a new login may start") {
                let next = try broker.client().call("io.tokenbroker.Broker.CodeLogin", ["session": "web"], more: true)
                return next.parameters["event"] == "prompt"
            }
        }
    }

    @Test("a code taken is redeemed to the end even when the caller leaves meanwhile: the session is logged in, not left with a spent code and an unrevoked refresh token")
    func callerLeavesDuringRedemption() async throws {
        try await Self.withIssuerAndBroker { issuer, broker in
            var login: (client: VarlinkClient, authorizationUri: String, redirectUri: String)? = try Self.begin(broker)
            let port = try #require(Self.port(of: login?.redirectUri ?? ""))
            let redirect = try Self.authorize(issuer, login?.authorizationUri ?? "")
            issuer.inject([.hold])
            // The browser's request waits for the login's result, in a thread of its own.
            let page = Locked<Int?>(nil)
            let target = redirect.target
            let browser = Thread {
                let status = Self.get(port, target)?.status
                page.withLock { $0 = status }
            }
            browser.start()
            try await eventually("the redemption is held at the issuer") { issuer.heldCount == 1 }
            login = nil   // the caller goes away while the token request is under way
            #expect(login == nil)
            issuer.releaseHeld()
            try await eventually("the login is installed") { try broker.status("web")?["generation"] == 1 }
            try await eventually("the browser's page") { page.value != nil }
            #expect(page.value == 200)
            #expect(try broker.call("GetToken", ["session": "web"]).error == nil)
            #expect(issuer.counters.revocations == 0)
        }
    }

    @Test("no redirect within LoginTimeout=: the login fails saying so, and its listener closes")
    func timeout() async throws {
        try await Self.withIssuerAndBroker(timeout: "1s") { _, broker in
            let login = try Self.begin(broker)
            #expect(Self.loginFailed(try login.client.nextReply()) == "no redirect came within 1 s (LoginTimeout=): log in again")
            // (It closes as the login ends, right after the reply: not at the same instant.)
            let port = try #require(Self.port(of: login.redirectUri))
            try await eventually("the listener is closed") { LoopbackTCP.connect(port).closing() < 0 }
        }
    }

    @Test("LoginRedirectPorts=: the first free port of the list; none free is a clear failure")
    func ports() async throws {
        let busy = try LoopbackListener { fd in close(fd) }
        defer { busy.stop() }
        let free = try LoopbackListener { fd in close(fd) }
        let freePort = free.port
        free.stop()
        try await Self.withIssuerAndBroker(ports: "\(busy.port) \(freePort)") { _, broker in
            let login = try Self.begin(broker)
            #expect(login.redirectUri == "http://127.0.0.1:\(freePort)/callback")
        }
        try await Self.withIssuerAndBroker(ports: "\(busy.port)") { _, broker in
            let answer = try broker.client().call("io.tokenbroker.Broker.CodeLogin", ["session": "web"], more: true)
            #expect(Self.loginFailed(answer) == "no port of LoginRedirectPorts= (\(busy.port)) is free on 127.0.0.1")
        }
    }

    @Test("an ID token that does not carry the login's nonce is refused, nothing installed, its refresh token revoked")
    func idTokenNonce() async throws {
        try await Self.withIssuerAndBroker { issuer, broker in
            let login = try Self.begin(broker)
            issuer.inject([.idTokenNonce("someone-elses")])
            let redirect = try Self.authorize(issuer, login.authorizationUri)
            let port = try #require(Self.port(of: login.redirectUri))
            let page = try #require(Self.get(port, redirect.target))
            #expect(page.status == 403 && page.body.contains("nonce"))
            #expect(Self.loginFailed(try login.client.nextReply()) == "the id_token's nonce is not the login's (a replayed or injected ID token)")
            #expect(try broker.call("GetToken", ["session": "web"]).error == "io.tokenbroker.Broker.SignedOut")
            try await eventually("its refresh token is revoked") { issuer.counters.revocations == 1 }
        }
    }

    @Test("fuzz: random request lines, targets and redirect queries at the listener are each answered 4xx or closed; the login still completes")
    func fuzz() async throws {
        try await Self.withIssuerAndBroker { issuer, broker in
            let login = try Self.begin(broker)
            let port = try #require(Self.port(of: login.redirectUri))
            // A state one character off: every check before the state's is reached, and nothing
            // random can be the login's answer.
            var state = String(try #require(login.authorizationUri.firstRange(of: "state=").map { login.authorizationUri[$0.upperBound...].prefix { $0 != "&" } }))
            state = String(state.dropLast()) + (state.last == "A" ? "B" : "A")
            var random = SeededRandom(seed: UInt64(ProcessInfo.processInfo.environment["TB_FUZZ_SEED"] ?? "") ?? 26)
            let pieces = ["code", "state", "error", "=", "&", "%", "%zz", "%C3", "%00", "+", "#", "?", "/", "..", "\u{7F}", " ", "é", state,
                          String(repeating: "a", count: 3000), "error_description", "iss", "x"]
            let iterations = Int(ProcessInfo.processInfo.environment["TB_FUZZ_ITERATIONS"] ?? "") ?? 200
            for _ in 0..<iterations {
                var query = ""
                for _ in 0..<Int.random(in: 0...12, using: &random) { query += random.pick(pieces) }
                let target = random.pick(["/callback?", "/callback?state=\(state)&", "/callback", "/", "*"]) + query
                let method = random.pick(["GET", "GET", "POST", "HEAD", "G\u{0}T"])
                let host = random.pick(["127.0.0.1:\(port)", "127.0.0.1:\(port)", "127.0.0.1", "evil.example:\(port)"])
                if let answer = Self.raw(port, "\(method) \(target) HTTP/1.1\r\nHost: \(host)\r\n\r\n") {
                    #expect((400...499).contains(answer.status), "HTTP \(answer.status)")
                }
            }
            // The login was not answered by any of it.
            let page = try #require(Self.get(port, (try Self.authorize(issuer, login.authorizationUri)).target))
            #expect(page.status == 200)
            #expect(try login.client.nextReply().parameters["generation"] == 1)
        }
    }
}

private extension Int32 {
    /// The descriptor closed again (for a connection made only to see whether one can be).
    func closing() -> Int32 {
        if self >= 0 { close(self) }
        return self
    }
}
