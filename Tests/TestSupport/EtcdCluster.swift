import Foundation
import Testing
#if canImport(Glibc)
import Glibc
#endif

/// A real etcd cluster (Debian's etcd-server) on loopback ports, in a temporary directory:
/// `members` processes, each with its own data directory. Stopped and removed by `stop()`.
public final class EtcdCluster: @unchecked Sendable {
    // @unchecked: set up in init, then only read; `children` are only signalled and awaited.
    public let directory: String
    public let clientURLs: [String]
    private let children: [Child]

    /// - Parameter answers: whether the member at a client URL answers a read (which needs the
    ///   cluster's quorum); the cluster is ready when every member does.
    /// - Parameter certificates: a `TestCertificates` directory: clients then speak HTTPS and
    ///   must present a certificate that CA signed (peers stay on plain loopback HTTP).
    public init(members: Int, certificates: String? = nil, answers: @escaping @Sendable (String) async -> Bool) async throws {
        // A port picked free may be taken by another test's server before etcd binds it, and a
        // busy machine starts three members slowly: a start that fails (a member exits) or takes
        // longer than a minute is tried again on new ports, twice at most.
        var problem = ""
        for _ in 0..<3 {
            let (directory, clientURLs, children) = try Self.launch(members: members, certificates: certificates)
            if let failure = await Self.ready(children, clientURLs, answers: answers, within: .seconds(60)) {
                problem = failure
                for child in children where child.process.isRunning { Glibc.kill(child.process.processIdentifier, SIGKILL) }
                for child in children { _ = await child.wait(timeout: 20) }
                try? FileManager.default.removeItem(atPath: directory)
                continue
            }
            (self.directory, self.clientURLs, self.children) = (directory, clientURLs, children)
            return
        }
        throw TimedOut(what: "an etcd cluster of \(members) to start (three tries): \(problem)")
    }

    /// Starts `members` etcd processes on ports free now, in a new directory.
    private static func launch(members: Int, certificates: String?) throws -> (String, [String], [Child]) {
        var template = Array("/tmp/tb-etcd-XXXXXX".utf8CString)
        guard let path = mkdtemp(&template) else { throw POSIXError(.EIO) }
        let directory = String(cString: path)
        let ports = try (0..<(2 * members)).map { _ in try Self.freePort() }
        let names = (0..<members).map { "m\($0)" }
        let peers = (0..<members).map { "http://127.0.0.1:\(ports[2 * $0 + 1])" }
        let clientURLs = (0..<members).map { "\(certificates == nil ? "http" : "https")://127.0.0.1:\(ports[2 * $0])" }
        let tls = certificates.map { ["--cert-file", $0 + "/etcd.pem", "--key-file", $0 + "/etcd.key",
                                      "--client-cert-auth", "--trusted-ca-file", $0 + "/ca.pem"] } ?? []
        let initial = zip(names, peers).map { "\($0)=\($1)" }.joined(separator: ",")
        var started: [Child] = []
        for index in 0..<members {
            started.append(try Child("/usr/bin/etcd", [
                "--name", names[index], "--data-dir", directory + "/" + names[index],
                "--listen-client-urls", clientURLs[index], "--advertise-client-urls", clientURLs[index],
                "--listen-peer-urls", peers[index], "--initial-advertise-peer-urls", peers[index],
                "--initial-cluster", initial, "--initial-cluster-state", "new", "--initial-cluster-token", "tb-\(getpid())-\(ports[0])",
                "--heartbeat-interval", "50", "--election-timeout", "500", "--log-level", "warn",
            ] + tls, directory: directory))
        }
        return (directory, clientURLs, started)
    }

    /// Nil once every member answers a read (which needs the cluster's quorum); else why not:
    /// a member exited, or `limit` passed.
    private static func ready(_ children: [Child], _ clientURLs: [String], answers: @escaping @Sendable (String) async -> Bool,
                              within limit: Duration) async -> String? {
        let deadline = ContinuousClock.now + limit
        var pending = clientURLs
        while !pending.isEmpty {
            if let gone = children.firstIndex(where: { !$0.process.isRunning }) {
                return "member \(gone) exited: \(children[gone].stderr.suffix(300))"
            }
            guard ContinuousClock.now < deadline else { return "\(pending.joined(separator: ", ")) did not answer within \(limit)" }
            var still: [String] = []
            for url in pending where !(await answers(url)) { still.append(url) }
            pending = still
            if !pending.isEmpty { try? await Task.sleep(for: .milliseconds(20)) }
        }
        return nil
    }

    /// A port nothing listens on now (the kernel's pick for port 0).
    public static func freePort() throws -> Int {
        let fd = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
        guard fd >= 0 else { throw POSIXError(.EIO) }
        defer { close(fd) }
        var address = sockaddr_in()
        address.sin_family = sa_family_t(AF_INET)
        address.sin_addr.s_addr = inet_addr("127.0.0.1")
        var length = socklen_t(MemoryLayout<sockaddr_in>.size)
        let bound = withUnsafeMutablePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { bind(fd, $0, length) == 0 && getsockname(fd, $0, &length) == 0 }
        }
        guard bound else { throw POSIXError(.EADDRINUSE) }
        return Int(UInt16(bigEndian: address.sin_port))
    }

    /// Stops member `index` (SIGKILL: a lost host).
    public func kill(_ index: Int) {
        Glibc.kill(children[index].process.processIdentifier, SIGKILL)
    }

    /// Stops member `index` (SIGSTOP: a member that hangs, or is cut off).
    public func pause(_ index: Int) {
        Glibc.kill(children[index].process.processIdentifier, SIGSTOP)
    }

    public func resume(_ index: Int) {
        Glibc.kill(children[index].process.processIdentifier, SIGCONT)
    }

    public func stop() async {
        for child in children where child.process.isRunning { Glibc.kill(child.process.processIdentifier, SIGCONT) }
        for child in children where child.process.isRunning { Glibc.kill(child.process.processIdentifier, SIGTERM) }
        for child in children { _ = await child.wait(timeout: 20) }
        try? FileManager.default.removeItem(atPath: directory)
    }
}
