import Foundation
import Testing
import TestSupport
import TokenBrokerCore
@testable import Upstream
import HTTPTransport

/// HTTPS with a private CA (`CAFile=`) and a client certificate (mTLS), against a Python TLS
/// server on loopback whose certificates the test makes with openssl.
@Suite("TLS: private CA and client certificates", .serialized)
struct TLSTests {
    static func makeCertificates() async throws -> String { try await TestCertificates.make() }

    /// A TLS token endpoint: answers every POST with a token whose value says whether the
    /// client presented a certificate the CA signed. Stopped when the test lets go of it.
    final class Server: Sendable {
        let child: Child
        let port: Int

        init(_ directory: String) async throws {
            let script = """
                import http.server, json, ssl, sys
                class H(http.server.BaseHTTPRequestHandler):
                    disable_nagle_algorithm = True
                    def do_POST(self):
                        self.rfile.read(int(self.headers.get('Content-Length', 0)))
                        body = json.dumps({"access_token": "mtls" if self.connection.getpeercert() else "plain",
                                           "token_type": "Bearer", "expires_in": 60}).encode()
                        self.send_response(200); self.send_header('Content-Type', 'application/json')
                        self.send_header('Content-Length', str(len(body))); self.end_headers(); self.wfile.write(body)
                    def log_message(self, *args): pass
                server = http.server.HTTPServer(('127.0.0.1', 0), H)
                context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
                context.load_cert_chain('\(directory)/server.pem', '\(directory)/server.key')
                context.load_verify_locations('\(directory)/ca.pem')
                context.verify_mode = ssl.CERT_OPTIONAL
                server.socket = context.wrap_socket(server.socket, server_side=True)
                print(server.server_address[1], flush=True)
                server.serve_forever()
                """
            let child = try Child("/usr/bin/env", ["python3", "-c", script], directory: directory)
            try await eventually("the TLS server's port") { Int(child.stdout.trimmingCharacters(in: .whitespacesAndNewlines)) != nil }
            self.child = child
            port = Int(child.stdout.trimmingCharacters(in: .whitespacesAndNewlines)) ?? 0
        }
    }

    static func client(_ port: Int, _ tls: TLSOptions) -> OAuthClient {
        OAuthClient(endpoints: OAuthEndpoints(token: "https://127.0.0.1:\(port)/token"),
                    configuration: OAuthClientConfiguration(clientID: "tokenbroker", clientSecret: Secret("s"), tls: tls, timeout: .seconds(10)))
    }

    @Test("CAFile= trusts the private CA; the system store alone and an unrelated CA do not")
    func privateCA() async throws {
        let directory = try await Self.makeCertificates()
        let server = try await Server(directory)
        let trusted = try await Self.client(server.port, TLSOptions(caFile: directory + "/ca.pem")).refresh(Secret("r"))
        #expect(trusted.accessToken == Secret("plain"))
        for tls in [TLSOptions(), TLSOptions(caFile: directory + "/other.pem")] {
            do {
                _ = try await Self.client(server.port, tls).refresh(Secret("r"))
                Issue.record("an untrusted server was accepted")
            } catch {
                #expect(error.kind == .transient(retryAfter: nil) && error.reason.hasPrefix("TLS:"), "\(error.reason)")
            }
        }
    }

    @Test("a client certificate and key (mTLS) are presented")
    func clientCertificate() async throws {
        let directory = try await Self.makeCertificates()
        let server = try await Server(directory)
        let token = try await Self.client(server.port, TLSOptions(caFile: directory + "/ca.pem", clientCertificate: directory + "/client.pem",
                                                                  clientKey: directory + "/client.key")).refresh(Secret("r"))
        #expect(token.accessToken == Secret("mtls"))
    }
}
