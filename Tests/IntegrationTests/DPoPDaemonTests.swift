import DevIssuer
import DPoP
import Foundation
#if canImport(FoundationNetworking)
import FoundationNetworking
#endif
import Sealing
import SQLiteStore
import Testing
import TestSupport
import TokenBrokerClient
import TokenBrokerURLSession
import Varlink
import TokenBrokerCore

/// DPoP sessions (RFC 9449) through the real daemon, against the development issuer enforcing
/// DPoP at its token endpoint and its resource (proof signature, htm/htu/iat, jti replay, ath,
/// the token's cnf.jkt, nonces of its own at each).
@Suite("DPoP sessions through the daemon", .serialized)
struct DPoPDaemonTests {
    static let stateKey = String(repeating: "0123456789abcdef", count: 4)

    static func config(_ issuer: DevIssuer, directory: String? = nil) -> String {
        """
        [Broker]
        SocketMode=0666
        \(directory.map { "StateKeyFile=\($0)/state.key" } ?? "")

        [Session]
        Name=api
        TokenEndpoint=\(issuer.tokenEndpoint)
        RevocationEndpoint=\(issuer.revocationEndpoint)
        ClientID=tokenbroker
        ClientSecretFile=@DIR@/client-secret
        DPoP=yes
        Serves=http://127.0.0.1:\(issuer.port)/
        RequestTimeout=5s

        """
    }

    /// An issuer that requires DPoP and nonces at both places.
    static func issuer(nonces: Bool = true) throws -> DevIssuer {
        var options = DevIssuer.Options()
        options.dpop = .required
        options.dpopNonces = nonces
        return try DevIssuer(options: options)
    }

    static func withDPoPBroker(nonces: Bool = true, extra: String = "", _ body: (DevIssuer, Broker) async throws -> Void) async throws {
        let issuer = try Self.issuer(nonces: nonces)
        defer { issuer.stop() }
        try await withBroker(config: Self.config(issuer) + extra) { broker in
            let login = try await broker.ctl(["login", "api", "--refresh-token-stdin"], stdin: issuer.issueRefreshToken() + "\n")
            #expect(login.code == 0, "\(login.err)")
            try await body(issuer, broker)
        }
    }

    /// One request to the issuer's resource with these headers: its status, challenge and nonce.
    static func resource(_ issuer: DevIssuer, _ headers: [(name: String, value: String)], method: String = "GET",
                         path: String = "/resource") async throws -> (status: Int, challenge: String, nonce: String?) {
        var request = URLRequest(url: URL(string: issuer.baseURL + path)!)
        request.httpMethod = method
        request.timeoutInterval = 10
        for header in headers { request.setValue(header.value, forHTTPHeaderField: header.name) }
        let (_, response) = try await URLSession.shared.data(for: request)
        let http = try #require(response as? HTTPURLResponse)
        return (http.statusCode, http.value(forHTTPHeaderField: "WWW-Authenticate") ?? "", http.value(forHTTPHeaderField: "DPoP-Nonce"))
    }

    /// The GetProof reply's headers, for `url`.
    static func proof(_ broker: Broker, _ url: String, method: String = "GET", nonce: String? = nil,
                      rejected: String? = nil, session: String = "api", resource: String? = nil) throws -> (token: String, type: String, proof: String) {
        var parameters: JSONObject = ["session": .string(session), "method": .string(method), "uri": .string(url)]
        if let resource { parameters["resource"] = .string(resource) }
        if let nonce { parameters["nonce"] = .string(nonce) }
        if let rejected { parameters["rejected"] = .string(rejected) }
        let reply = try broker.call("GetProof", parameters)
        #expect(reply.error == nil, "GetProof: \(reply.error ?? "")")
        return (reply.parameters["token"]?.stringValue ?? "", reply.parameters["tokenType"]?.stringValue ?? "",
                reply.parameters["proof"]?.stringValue ?? "")
    }

    static func headers(_ proof: (token: String, type: String, proof: String)) -> [(name: String, value: String)] {
        [("Authorization", "\(proof.type) \(proof.token)"), ("DPoP", proof.proof)]
    }

    @Test("end to end: the first refresh proves the login's key (one nonce round trip at the token endpoint); ctl proof prints the two headers curl sends; the Swift client's data(for:) answers the resource's nonce with one retry")
    func endToEnd() async throws {
        try await Self.withDPoPBroker { issuer, broker in
            let ctl = try await broker.ctl(["proof", "api", "GET", issuer.resourceURL])
            #expect(ctl.code == 0, "\(ctl.err)")
            let lines = ctl.out.split(separator: "\n").map(String.init)
            try #require(lines.count == 2 && lines[0].hasPrefix("Authorization: DPoP ") && lines[1].hasPrefix("DPoP: "),
                         "ctl proof printed \(lines.count) lines")
            #expect(issuer.counters.refreshGrants == 1 && issuer.counters.dpopNonceChallenges == 1 && issuer.counters.tokenRequests == 2,
                    "one refresh, one nonce round trip: \(issuer.counters)")
            let token = String(lines[0].dropFirst("Authorization: DPoP ".count))
            let key = try #require(issuer.thumbprint(ofAccessToken: token), "the token is DPoP-bound at the issuer")
            #expect((try? DPoPVerifier.verify(String(lines[1].dropFirst("DPoP: ".count)), method: "GET", url: issuer.resourceURL,
                                               now: Int64(Date().timeIntervalSince1970), accessToken: token))?.thumbprint == key)

            // curl with those headers: the resource asks for its nonce first; ctl proof --nonce.
            let headerFile = broker.directory + "/headers"
            try ctl.out.write(toFile: headerFile, atomically: true, encoding: .utf8)
            let first = try Child("/usr/bin/curl", ["-s", "-o", "/dev/null", "-w", "%{http_code}", "-D", broker.directory + "/first.head",
                                                    "-H", "@" + headerFile, issuer.resourceURL], directory: broker.directory)
            #expect(await first.wait() == 0 && first.stdout == "401")
            let head = (try? String(contentsOfFile: broker.directory + "/first.head", encoding: .utf8)) ?? ""
            #expect(head.contains("use_dpop_nonce"))
            let nonce = issuer.currentResourceNonce
            let again = try await broker.ctl(["proof", "api", "GET", issuer.resourceURL, "--nonce", nonce])
            try again.out.write(toFile: headerFile, atomically: true, encoding: .utf8)
            let second = try Child("/usr/bin/curl", ["-s", "-o", "/dev/null", "-w", "%{http_code}", "-H", "@" + headerFile, issuer.resourceURL],
                                   directory: broker.directory)
            #expect(await second.wait() == 0 && second.stdout == "200", "curl with the broker's proof and the nonce: \(second.stdout)")

            // The Swift client: after a rotation the resource challenges once, and data(for:) retries once.
            issuer.rotateDPoPNonces()
            let client = TokenBrokerClient(socketPath: broker.socket)
            let before = issuer.counters
            var request = URLRequest(url: URL(string: issuer.resourceURL + "?x=1")!)
            request.timeoutInterval = 10
            let (_, response) = try await client.data(for: request, session: "api")
            #expect((response as HTTPURLResponse).statusCode == 200)
            let after = issuer.counters
            #expect(after.resourceRequests - before.resourceRequests == 2 && after.dpopNonceChallenges - before.dpopNonceChallenges == 1,
                    "one nonce challenge, one retry: \(after.resourceRequests - before.resourceRequests) requests")
            #expect(after.refreshGrants == before.refreshGrants, "the token stayed: no refresh")
            #expect(after.dpopProofsRefused == 0, "the broker's proofs were never refused")

            // The credential helpers cannot carry a proof: they say so and hand out nothing.
            let git = try Child(Paths.tokenbroker, ["credential", "git", "get"], environment: ["TOKENBROKER_SOCKET": broker.socket],
                                directory: broker.directory, stdin: "protocol=http\nhost=127.0.0.1:\(issuer.port)\n\n")
            #expect(await git.wait() != 0 && git.stdout.isEmpty && git.stderr.contains("DPoP"), "\(git.stderr)")
        }
    }

    @Test("the resource refuses a replayed proof, a proof for another URL or method, the token without its proof, and the token with another key's proof; the broker makes none of them")
    func refusals() async throws {
        try await Self.withDPoPBroker(nonces: false) { issuer, broker in
            let url = issuer.resourceURL
            let good = try Self.proof(broker, url)
            #expect(good.type == "DPoP")
            #expect(try await Self.resource(issuer, Self.headers(good)).status == 200)
            let replayed = try await Self.resource(issuer, Self.headers(good))
            #expect(replayed.status == 401 && replayed.challenge.contains("invalid_dpop_proof"), "a replayed proof")
            let otherURL = try Self.proof(broker, issuer.baseURL + "/elsewhere")
            #expect(try await Self.resource(issuer, Self.headers(otherURL)).status == 401, "a proof for another URL")
            let otherMethod = try Self.proof(broker, url, method: "POST")
            #expect(try await Self.resource(issuer, Self.headers(otherMethod)).status == 401, "a proof for another method")
            let bare = try Self.proof(broker, url)
            #expect(try await Self.resource(issuer, [("Authorization", "Bearer \(bare.token)")]).status == 401, "the token as a bearer token")
            #expect(try await Self.resource(issuer, [("Authorization", "DPoP \(bare.token)")]).status == 401, "the token without a proof")
            let stranger = try DPoPKey()
            let foreign = try DPoPProof.make(key: stranger, method: "GET", url: url, issuedAt: Int64(Date().timeIntervalSince1970),
                                             accessToken: bare.token)
            #expect(try await Self.resource(issuer, [("Authorization", "DPoP \(bare.token)"), ("DPoP", foreign)]).status == 401,
                    "the token with another key's proof")
            // Each proof the broker made is unique and verifies for its own request.
            var jtis: Set<String> = []
            for _ in 0..<20 {
                let made = try Self.proof(broker, url + "?q=1", method: "PUT")
                let verified = try DPoPVerifier.verify(made.proof, method: "PUT", url: url, now: Int64(Date().timeIntervalSince1970),
                                                       accessToken: made.token)
                jtis.insert(verified.jti)
                #expect(verified.thumbprint == issuer.thumbprint(ofAccessToken: made.token))
            }
            #expect(jtis.count == 20)
            #expect(issuer.counters.dpopProofsRefused == 6, "the six refusals above, no other")
            // A bad request to GetProof is the caller's: InvalidParameter, nothing signed.
            for (method, uri) in [("get", url), ("GET", "ftp://x/"), ("GET", "https://x/" + String(repeating: "a", count: 5000))] {
                let reply = try broker.call("GetProof", ["session": "api", "method": .string(method), "uri": .string(uri)])
                #expect(reply.error == "org.varlink.service.InvalidParameter")
            }
        }
    }

    @Test("a storm on a DPoP session: 40 workers present the same old token to GetProof right after the issuer's nonce changed → 1 refresh, 1 nonce round trip, one new token for all")
    func storm() async throws {
        try await Self.withDPoPBroker { issuer, broker in
            let old = try Self.proof(broker, issuer.resourceURL).token
            issuer.rotateDPoPNonces()
            let before = issuer.counters
            let tokens = try await withThrowingTaskGroup(of: String.self) { group in
                for _ in 0..<40 {
                    group.addTask { try Self.proof(broker, issuer.resourceURL, rejected: old).token }
                }
                var tokens: Set<String> = []
                for try await token in group { tokens.insert(token) }
                return tokens
            }
            let after = issuer.counters
            #expect(tokens.count == 1 && fp(tokens.first) != fp(old))
            #expect(after.refreshGrants - before.refreshGrants == 1, "\(after.refreshGrants - before.refreshGrants) refreshes for one storm")
            #expect(after.dpopNonceChallenges - before.dpopNonceChallenges == 1 && after.tokenRequests - before.tokenRequests == 2)
            #expect(after.replays == 0 && after.dpopProofsRefused == 0)
            // Stale: the old token again gets the current one at once, with a proof, no request.
            let stale = try Self.proof(broker, issuer.resourceURL, nonce: issuer.currentResourceNonce, rejected: old)
            #expect(fp(stale.token) == fp(tokens.first) && issuer.counters.tokenRequests == after.tokenRequests)
            #expect(try await Self.resource(issuer, Self.headers(stale)).status == 200)
        }
    }

    @Test("logout ends the key with the generation; a new login makes a new key; a token bound to a key not ours is refused")
    func keyLifecycle() async throws {
        try await Self.withDPoPBroker(nonces: false) { issuer, broker in
            let first = try Self.proof(broker, issuer.resourceURL)
            let firstKey = try #require(issuer.thumbprint(ofAccessToken: first.token))
            #expect(try await broker.ctl(["logout", "api"]).code == 0)
            #expect(try broker.call("GetProof", ["session": "api", "method": "GET", "uri": .string(issuer.resourceURL)]).error
                    == "io.tokenbroker.Broker.SignedOut")
            #expect(try await broker.ctl(["login", "api", "--refresh-token-stdin"], stdin: issuer.issueRefreshToken() + "\n").code == 0)
            let second = try Self.proof(broker, issuer.resourceURL)
            let secondKey = try #require(issuer.thumbprint(ofAccessToken: second.token))
            #expect(secondKey != firstKey, "a new login, a new key")
            #expect((try? DPoPVerifier.verify(second.proof, method: "GET", url: issuer.resourceURL, now: Int64(Date().timeIntervalSince1970),
                                               accessToken: second.token))?.thumbprint == secondKey)

            issuer.inject([.bindToOtherKey])
            let refused = try broker.call("Recover", ["session": "api", "rejected": .string(second.token)])
            #expect(refused.error == "io.tokenbroker.Broker.RefreshFailed" && refused.parameters["retryable"] == false)
            #expect(refused.parameters["reason"] == "dpop: the access token is bound to another key; the answer's new refresh token was revoked: log in again")
            // The session ended: the spent refresh token is never sent again, the new one is revoked.
            #expect(try broker.status("api")?["state"] == "ended")
            #expect(issuer.activeRefreshTokens == 0 && issuer.counters.replays == 0)
        }
    }

    @Test("derived sessions and keys of a DPoP session, by exchange and by refresh: their requests prove the parent's key, their tokens are bound to it, GetProof on them signs with it and the resource takes it; a new login of the parent, a new key for them too; the issuer exchanges a bound token only with its key's proof")
    func derivedSessions() async throws {
        let extra = "AllowResources=https://k.example/\n"
            + "\n[Session]\nName=narrow\nDerivedFrom=api\nResource=https://r.example/\nScope=read\nAllowUsers=root\n"
            + "\n[Session]\nName=narrow-r\nDerivedFrom=api\nDerivation=refresh\nResource=https://s.example/\nAllowUsers=root\n"
        try await Self.withDPoPBroker(extra: extra) { issuer, broker in
            let now = { Int64(Date().timeIntervalSince1970) }
            for round in 0..<2 {
                let parent = try Self.proof(broker, issuer.resourceURL)
                let key = try #require(issuer.thumbprint(ofAccessToken: parent.token), "round \(round): the parent's token is bound")
                for (name, resource) in [("narrow", "https://r.example/"), ("narrow-r", "https://s.example/"), ("api", "https://k.example/")] {
                    // (`api` with a resource: its key.)
                    let derived = try Self.proof(broker, issuer.resourceURL, nonce: issuer.currentResourceNonce, session: name,
                                                 resource: name == "api" ? resource : nil)
                    #expect(derived.type == "DPoP" && issuer.audiences(ofAccessToken: derived.token) == [resource], "round \(round): \(name)")
                    #expect(issuer.thumbprint(ofAccessToken: derived.token) == key, "round \(round): \(name)'s token is bound to the parent's key")
                    #expect((try? DPoPVerifier.verify(derived.proof, method: "GET", url: issuer.resourceURL, now: now(),
                                                       accessToken: derived.token))?.thumbprint == key, "round \(round): \(name)'s proof")
                    #expect(try await Self.resource(issuer, Self.headers(derived)).status == 200, "round \(round): the resource takes \(name)'s proof")
                }
                #expect(issuer.counters.dpopProofsRefused == 0 && issuer.counters.replays == 0, "round \(round): \(issuer.counters)")
                // A new login: a new key for the parent and what it derives.
                #expect(try await broker.ctl(["login", "api", "--refresh-token-stdin"], stdin: issuer.issueRefreshToken() + "\n").code == 0)
            }
            let firstRound = issuer.counters.tokenExchanges
            #expect(firstRound == 4 && issuer.counters.narrowedRefreshes == 2, "two exchanges (a derived session, a key) and one redemption per round")

            // The issuer's side: a bound subject token with another key's proof is not exchanged.
            let parent = try Self.proof(broker, issuer.resourceURL)
            let stranger = try DPoPKey()
            let nonce = issuer.currentTokenNonce
            var request = URLRequest(url: URL(string: issuer.tokenEndpoint)!)
            request.httpMethod = "POST"
            request.timeoutInterval = 10
            request.setValue("Basic " + Data("tokenbroker:dev-secret".utf8).base64EncodedString(), forHTTPHeaderField: "Authorization")
            request.setValue("application/x-www-form-urlencoded", forHTTPHeaderField: "Content-Type")
            request.httpBody = Data(("grant_type=urn%3Aietf%3Aparams%3Aoauth%3Agrant-type%3Atoken-exchange&subject_token_type="
                                     + "urn%3Aietf%3Aparams%3Aoauth%3Atoken-type%3Aaccess_token&subject_token=" + parent.token).utf8)
            request.setValue(try DPoPProof.make(key: stranger, method: "POST", url: issuer.tokenEndpoint, issuedAt: now(), nonce: nonce),
                             forHTTPHeaderField: "DPoP")
            let (body, response) = try await URLSession.shared.data(for: request)
            #expect((response as? HTTPURLResponse)?.statusCode == 400
                    && String(decoding: body, as: UTF8.self).contains("The subject token is bound to another DPoP key"))
            #expect(issuer.counters.tokenExchanges == firstRound + 1)
        }
    }

    @Test("the key is nowhere but the sealed state: not in the journal, Status, Metrics or a reply (as DER, base64, its private scalar in any encoding); sealed in the database; gone from the database files after the logout")
    func keyStaysInside() async throws {
        let issuer = try Self.issuer(nonces: false)
        defer { issuer.stop() }
        let directory = try Paths.temporaryDirectory()
        try SecretFile.write(Self.stateKey, to: directory + "/state.key")
        let broker = try await Broker(config: Self.config(issuer, directory: directory))
        defer { try? FileManager.default.removeItem(atPath: broker.directory) }
        #expect(try await broker.ctl(["login", "api", "--refresh-token-stdin"], stdin: issuer.issueRefreshToken() + "\n").code == 0)
        let made = try Self.proof(broker, issuer.resourceURL)
        var outputs = [try await broker.ctl(["--json", "status"]).out, try await broker.ctl(["metrics"]).out,
                       try await broker.ctl(["--json", "proof", "api", "GET", issuer.resourceURL]).out, made.proof]

        // The key as the store keeps it, read from a copy of the database (the daemon runs on).
        let copy = try Paths.temporaryDirectory() + "/state"
        try FileManager.default.createDirectory(atPath: copy, withIntermediateDirectories: true)
        for suffix in ["", "-wal"] where FileManager.default.fileExists(atPath: broker.directory + "/state/state.db" + suffix) {
            try FileManager.default.copyItem(atPath: broker.directory + "/state/state.db" + suffix, toPath: copy + "/state.db" + suffix)
        }
        let sealed = try await Child.run("/usr/bin/env", ["python3", "-c",
            "import sqlite3; print(sqlite3.connect('\(copy)/state.db').execute('SELECT proof_key FROM sessions').fetchone()[0])"])
        let sealedKey = sealed.stdout.trimmingCharacters(in: .whitespacesAndNewlines)
        #expect(TokenCipher.isEncrypted(sealedKey), "the key is sealed in the database")
        let store = try SQLiteSessionStore(directory: copy, cipher: try TokenCipher(keyMaterial: Array(Self.stateKey.utf8)))
        let kept = try #require(try await store.load("api")?.proofKey?.reveal)
        let der = try #require(Data(base64Encoded: kept))
        let key = try DPoPKey(der: Array(der))
        #expect(key.thumbprint == issuer.thumbprint(ofAccessToken: made.token), "the stored key is the one the token is bound to")
        // Its private scalar d: ECPrivateKey's version 1, then an OCTET STRING of 32 bytes.
        let bytes = Array(der)
        let marker: [UInt8] = [0x02, 0x01, 0x01, 0x04, 0x20]
        let at = try #require((0...(bytes.count - marker.count - 32)).first { Array(bytes[$0..<($0 + marker.count)]) == marker })
        let scalar = Data(bytes[(at + marker.count)..<(at + marker.count + 32)])
        let forms = [kept, scalar.base64EncodedString(), scalar.map { String(format: "%02x", $0) }.joined()].flatMap { form in
            [form, form.replacingOccurrences(of: "+", with: "-").replacingOccurrences(of: "/", with: "_").replacingOccurrences(of: "=", with: "")]
        }

        #expect(try await broker.ctl(["logout", "api"]).code == 0)
        #expect(await broker.stop() == 0)
        outputs.append(broker.child.stderr)
        for (index, text) in outputs.enumerated() {
            #expect(!forms.contains { text.contains($0) }, "the key in output \(index)")
        }
        for suffix in ["", "-wal"] {
            let data = FileManager.default.contents(atPath: broker.directory + "/state/state.db" + suffix) ?? Data()
            #expect(data.range(of: der) == nil && data.range(of: scalar) == nil && data.range(of: Data(sealedKey.utf8)) == nil
                    && data.range(of: Data(kept.utf8)) == nil, "the key (or its sealed form) in state.db\(suffix) after the logout")
        }
    }
}
