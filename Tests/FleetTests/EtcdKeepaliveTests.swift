import Fleet
import Foundation
import Synchronization
import Testing
import TestSupport
import HTTPTransport
#if canImport(Glibc)
import Glibc
#endif

/// A silently dead connection under a watch: etcd alone in a network namespace, reached over a
/// veth pair, then cut off by dropping every packet there (iptables): no reset, no FIN, nothing
/// — a partition, a vanished host, a dropped NAT entry. TCP keepalive must end the watch.
@Suite("etcd watch on a dead connection", .serialized,
       .enabled(if: NamespacedEtcd.problem == nil,
                "needs root, /usr/sbin/ip and /usr/sbin/iptables (Debian: iproute2, iptables), and a network namespace where iptables works"))
struct EtcdKeepaliveTests {
    static let prefix = Array("/tb/keepalive/".utf8)

    /// Watches `prefix` for an hour from the current revision; returns when the stream is live
    /// (it brought a put made after it started), with what ends it.
    static func liveWatch(_ client: EtcdClient) async throws -> WatchProbe {
        let start = try await client.put(prefix + Array("before".utf8), Array("x".utf8)) + 1
        let probe = WatchProbe()
        probe.task = Task {
            let outcome: Result<WatchEnd, EtcdError>
            do throws(EtcdError) {
                outcome = .success(try await client.watch(prefix: prefix, from: start, for: .seconds(3600)) { events, _ in
                    probe.events.add(events.count, ordering: .relaxed)
                })
            } catch {
                outcome = .failure(error)
            }
            probe.ended.withLock { $0 = (outcome, ContinuousClock.now) }
        }
        _ = try await client.put(prefix + Array("after".utf8), Array("y".utf8))
        try await eventually("the watch to bring a put", timeout: .seconds(20)) { probe.events.load(ordering: .relaxed) > 0 }
        return probe
    }

    @Test("a watch whose member goes silent fails within the keepalive's deadline; one on a quiet live connection does not")
    func shortKeepalive() async throws {
        // Short, so the test is quick: dead 4 s after the last byte.
        let keepalive = TCPKeepalive(idle: .seconds(1), interval: .seconds(1), count: 3)
        try await NamespacedEtcd.with(keepalive: keepalive) { etcd in
            let client = EtcdClient(endpoints: [etcd.url], keepalive: keepalive)
            let probe = try await Self.liveWatch(client)
            // Twice the deadline of quiet on a live connection: the member answers the probes
            // (the kernel does), so the watch goes on. (A wait for nothing to happen.)
            try await Task.sleep(for: keepalive.deadline * 2)
            #expect(probe.ended.withLock { $0 } == nil, "a live, quiet watch ended")
            // (Slack for a loaded machine: the kernel's timers are exact, the test's wake-up is not.)
            let elapsed = try await probe.endsAfterCut(etcd, within: keepalive.deadline + .seconds(8))
            print("keepalive \(keepalive.deadline): a dead connection's watch failed \(elapsed) after the cut")
            #expect(elapsed <= keepalive.deadline + .seconds(6))
        }
    }

    /// (Forty-five seconds of waiting: run with TB_KEEPALIVE_FULL=1; the short test above proves
    /// the mechanism in every run.)
    @Test("with the daemon's keepalive a watch on a dead connection fails within 45 s of the cut",
          .enabled(if: ProcessInfo.processInfo.environment["TB_KEEPALIVE_FULL"] == "1", "45 s: set TB_KEEPALIVE_FULL=1"))
    func daemonKeepalive() async throws {
        let keepalive = EtcdClient.deadConnection
        #expect(keepalive.deadline == .seconds(45))
        try await NamespacedEtcd.with(keepalive: keepalive) { etcd in
            let client = EtcdClient(endpoints: [etcd.url])
            let probe = try await Self.liveWatch(client)
            let elapsed = try await probe.endsAfterCut(etcd, within: keepalive.deadline + .seconds(5))
            print("keepalive \(keepalive.deadline): a dead connection's watch failed \(elapsed) after the cut")
            #expect(elapsed <= keepalive.deadline + .seconds(2))
        }
    }
}

/// A watch under way: how many events it brought, and how (and when) it ended.
final class WatchProbe: @unchecked Sendable {
    // @unchecked: `task` is set once, before any other task reads it; the rest is atomic or locked.
    let events = Atomic<Int>(0)
    let ended = Mutex<(Result<WatchEnd, EtcdError>, ContinuousClock.Instant)?>(nil)
    var task: Task<Void, Never>?

    /// Cuts the member off and waits (up to `limit`) for the watch to fail; returns how long
    /// after the cut it did.
    func endsAfterCut(_ etcd: NamespacedEtcd, within limit: Duration) async throws -> Duration {
        try await etcd.cut()
        let cut = ContinuousClock.now
        defer { task?.cancel() }
        try await eventually("the watch on the dead connection to end", timeout: limit) { self.ended.withLock { $0 } != nil }
        let (outcome, at) = try #require(ended.withLock { $0 })
        switch outcome {
        case let .failure(error): #expect(error.kind == .unavailable, "\(error)")
        case let .success(end): Issue.record("the watch ended \(end), not failed")
        }
        return at - cut
    }
}

/// One etcd member alone in a network namespace of its own, at `url` over a veth pair.
final class NamespacedEtcd: Sendable {
    let namespace: String
    let hostLink: String
    let url: String
    let directory: String
    let child: Child

    /// Why no namespace with iptables can be made here, or nil (tried once: a namespace made,
    /// iptables listed in it, and removed).
    static let problem: String? = {
        guard getuid() == 0 else { return "not root" }
        for tool in ["/usr/sbin/ip", "/usr/sbin/iptables", "/usr/bin/etcd"] where !FileManager.default.isExecutableFile(atPath: tool) {
            return "no \(tool)"
        }
        let name = "tbk-probe-\(getpid())"
        defer { _ = runNow(["netns", "del", name]) }
        guard runNow(["netns", "add", name]) else { return "ip netns add failed" }
        guard runNow(["netns", "exec", name, "/usr/sbin/iptables", "-L", "-n"]) else { return "iptables failed in a namespace" }
        return nil
    }()

    /// Runs `ip` with `arguments` to its end (only for the probe above, before any test).
    private static func runNow(_ arguments: [String]) -> Bool {
        let process = Process()
        process.executableURL = URL(fileURLWithPath: "/usr/sbin/ip")
        process.arguments = arguments
        process.standardOutput = FileHandle.nullDevice
        process.standardError = FileHandle.nullDevice
        guard (try? process.run()) != nil else { return false }
        process.waitUntilExit()
        return process.terminationStatus == 0
    }

    private static let made = Atomic<Int>(0)

    /// Runs `body` with a namespaced member, removed afterwards whatever `body` did. Its
    /// readiness is asked with `keepalive`: a connection libcurl pools keeps the keepalive of
    /// the request that opened it, and the test's requests may reuse it.
    static func with(keepalive: TCPKeepalive, _ body: (NamespacedEtcd) async throws -> Void) async throws {
        let etcd = try await NamespacedEtcd(keepalive: keepalive)
        do {
            try await body(etcd)
        } catch {
            await etcd.stop()
            throw error
        }
        await etcd.stop()
    }

    private init(keepalive: TCPKeepalive) async throws {
        let serial = Self.made.add(1, ordering: .relaxed).newValue
        let tag = "\(getpid() % 100_000)\(serial % 10)"
        namespace = "tbk\(tag)"
        hostLink = "tbkh\(tag)"
        let inside = "tbkn\(tag)"
        let subnet = "10.214.\((Int(getpid()) &* 7 &+ serial) % 256)"
        url = "http://\(subnet).2:2379"
        var template = Array("/tmp/tb-etcd-ns-XXXXXX".utf8CString)
        guard let path = mkdtemp(&template) else { throw POSIXError(.EIO) }
        directory = String(cString: path)
        for step in [["netns", "add", namespace], ["link", "add", hostLink, "type", "veth", "peer", "name", inside],
                     ["link", "set", inside, "netns", namespace], ["addr", "add", "\(subnet).1/30", "dev", hostLink],
                     ["link", "set", hostLink, "up"], ["netns", "exec", namespace, "ip", "addr", "add", "\(subnet).2/30", "dev", inside],
                     ["netns", "exec", namespace, "ip", "link", "set", inside, "up"], ["netns", "exec", namespace, "ip", "link", "set", "lo", "up"]] {
            let run = try await Child.run("/usr/sbin/ip", step, timeout: 20)
            guard run.code == 0 else {
                await Self.remove(namespace, hostLink)
                throw NamespaceFailed(step: step.joined(separator: " "), stderr: String(run.stderr.prefix(200)))
            }
        }
        // `ip netns exec` execs etcd: the child is the member itself.
        child = try Child("/usr/sbin/ip", ["netns", "exec", namespace, "/usr/bin/etcd",
                                           "--name", "m0", "--data-dir", directory + "/m0",
                                           "--listen-client-urls", url, "--advertise-client-urls", url,
                                           "--listen-peer-urls", "http://127.0.0.1:2380", "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
                                           "--initial-cluster", "m0=http://127.0.0.1:2380", "--initial-cluster-state", "new",
                                           "--log-level", "warn"], directory: directory)
        let url = self.url
        do {
            try await eventually("the namespaced etcd to answer", timeout: .seconds(60)) {
                (try? await EtcdClient(endpoints: [url], timeout: .milliseconds(500), keepalive: keepalive).get(Array("ready".utf8))) != nil
            }
        } catch {
            await stop()
            throw error
        }
    }

    /// Drops every packet in and out of the namespace: the member goes silent, nobody resets.
    func cut() async throws {
        for chain in ["INPUT", "OUTPUT"] {
            let run = try await Child.run("/usr/sbin/ip", ["netns", "exec", namespace, "/usr/sbin/iptables", "-A", chain, "-j", "DROP"], timeout: 20)
            #expect(run.code == 0, "iptables -A \(chain) -j DROP: \(run.stderr.prefix(200))")
        }
    }

    func stop() async {
        child.kill()
        _ = await child.wait(timeout: 20)
        await Self.remove(namespace, hostLink)
        try? FileManager.default.removeItem(atPath: directory)
    }

    private static func remove(_ namespace: String, _ hostLink: String) async {
        _ = try? await Child.run("/usr/sbin/ip", ["netns", "del", namespace], timeout: 20)
        _ = try? await Child.run("/usr/sbin/ip", ["link", "del", hostLink], timeout: 20)
    }
}

/// An `ip` step of a namespace's set-up failed.
struct NamespaceFailed: Error, CustomStringConvertible {
    let step: String
    let stderr: String
    var description: String { "ip \(step) failed: \(stderr)" }
}
