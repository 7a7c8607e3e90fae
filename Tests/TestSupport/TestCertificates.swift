import Foundation
import Testing

/// Certificates made with openssl for the TLS tests.
public enum TestCertificates {
    /// A CA (`ca.pem`), a server certificate for 127.0.0.1 (`server.pem`, `server.key`), a
    /// client certificate (`client.pem`, `client.key`), a certificate for etcd (`etcd.pem`,
    /// `etcd.key`: server and client use, since etcd's JSON gateway dials etcd's own gRPC port
    /// with it) and an unrelated CA (`other.pem`), in a fresh directory.
    public static func make() async throws -> String {
        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("tb-tls-\(UUID().uuidString.prefix(8))").path
        try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
        let script = """
            set -e
            cd '\(directory)'
            openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 -subj /CN=tokenbroker-test-ca 2>/dev/null
            openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj /CN=127.0.0.1 2>/dev/null
            printf 'subjectAltName=IP:127.0.0.1\\nextendedKeyUsage=serverAuth\\n' > server.ext
            openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem -days 2 -extfile server.ext 2>/dev/null
            openssl req -newkey rsa:2048 -nodes -keyout client.key -out client.csr -subj /CN=tokenbroker-client 2>/dev/null
            printf 'extendedKeyUsage=clientAuth\\n' > client.ext
            openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out client.pem -days 2 -extfile client.ext 2>/dev/null
            openssl req -newkey rsa:2048 -nodes -keyout etcd.key -out etcd.csr -subj /CN=127.0.0.1 2>/dev/null
            printf 'subjectAltName=IP:127.0.0.1\\nextendedKeyUsage=serverAuth,clientAuth\\n' > etcd.ext
            openssl x509 -req -in etcd.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out etcd.pem -days 2 -extfile etcd.ext 2>/dev/null
            openssl req -x509 -newkey rsa:2048 -nodes -keyout other.key -out other.pem -days 2 -subj /CN=unrelated-ca 2>/dev/null
            """
        let made = try await Child.run("/bin/sh", ["-c", script])
        guard made.code == 0 else { throw POSIXError(.EIO) }
        return directory
    }

}
