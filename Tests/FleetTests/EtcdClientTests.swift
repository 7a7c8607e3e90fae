#if canImport(Glibc)
import Glibc
#endif
import Fleet
import Foundation
import Synchronization
import Testing
import TestSupport
import HTTPTransport

/// The etcd client against a real 3-member etcd cluster on loopback.
@Suite("etcd client", .serialized)
struct EtcdClientTests {
    static func bytes(_ text: String) -> [UInt8] { Array(text.utf8) }

    @Test("put, get (missing, empty and binary values), and revisions that grow")
    func putAndGet() async throws {
        let cluster = try await EtcdCluster(members: 3, answers: etcdAnswers)
        let client = EtcdClient(endpoints: cluster.clientURLs)
        let missing = try await client.get(Self.bytes("/tb/none"))
        #expect(missing.record == nil && missing.revision >= 1)
        let first = try await client.put(Self.bytes("/tb/a"), [0, 1, 2, 255])
        let record = try #require(try await client.get(Self.bytes("/tb/a")).record)
        #expect(record.value == [0, 1, 2, 255] && record.createRevision == first && record.modRevision == first && record.version == 1)
        let second = try await client.put(Self.bytes("/tb/a"), [])
        #expect(second > first)
        let empty = try #require(try await client.get(Self.bytes("/tb/a")).record)
        #expect(empty.value == [] && empty.createRevision == first && empty.modRevision == second && empty.version == 2)
        await cluster.stop()
    }

    @Test("create-if-absent transactions: of 20 contenders at once exactly one wins; the losers read the winner's record")
    func oneWinner() async throws {
        let cluster = try await EtcdCluster(members: 3, answers: etcdAnswers)
        let key = Self.bytes("/tb/flight")
        final class Tally: Sendable {
            let winners = Mutex<[Int]>([])
            let readers = Mutex<[Int]>([])
        }
        let tally = Tally()
        await withTaskGroup(of: Void.self) { group in
            for contender in 0..<20 {
                group.addTask {
                    // Each through a different first member: the cluster, not one member, decides.
                    let endpoints = Array(cluster.clientURLs[(contender % 3)...] + cluster.clientURLs[..<(contender % 3)])
                    // A generous deadline: 20 transactions at once on a loaded 2-core machine.
                    let client = EtcdClient(endpoints: endpoints, timeout: .seconds(10))
                    guard let outcome = try? await client.transaction([.createRevision(key: key, equals: 0)],
                                                                      success: [.put(key: key, value: Self.bytes("\(contender)"), lease: 0)],
                                                                      failure: [.get(key: key)]) else { return }
                    if outcome.succeeded {
                        tally.winners.withLock { $0.append(contender) }
                    } else if let read = outcome.reads.first, let record = read, let holder = Int(String(decoding: record.value, as: UTF8.self)) {
                        tally.readers.withLock { $0.append(holder) }
                    }
                }
            }
        }
        let won = tally.winners.withLock { $0 }
        let read = tally.readers.withLock { $0 }
        #expect(won.count == 1, "\(won)")
        #expect(read.count == 19 && Set(read) == Set(won), "\(read)")
        await cluster.stop()
    }

    @Test("a prefix: 300 keys read in pages, in key order, none from beside the prefix; a watch of the prefix brings its changes only, and ends when its time is up")
    func prefix() async throws {
        let cluster = try await EtcdCluster(members: 3, answers: etcdAnswers)
        let client = EtcdClient(endpoints: cluster.clientURLs)
        for index in 0..<300 { try await client.put(Self.bytes("/tb/p/k\(1000 + index)"), Self.bytes("\(index)")) }
        try await client.put(Self.bytes("/tb/p"), Self.bytes("beside"))
        let last = try await client.put(Self.bytes("/tb/q/k"), Self.bytes("beside"))
        let read = try await client.range(prefix: Self.bytes("/tb/p/"))
        #expect(read.records.map { String(decoding: $0.key, as: UTF8.self) } == (0..<300).map { "/tb/p/k\(1000 + $0)" })
        #expect(read.records.last?.value == Self.bytes("299") && read.revision == last)
        let seen = Mutex<[String]>([])
        async let end = client.watch(prefix: Self.bytes("/tb/p/"), from: read.revision + 1, for: .seconds(3)) { events, _ in
            seen.withLock { $0 += events.map { String(decoding: $0.record.key, as: UTF8.self) } }
        }
        try await client.put(Self.bytes("/tb/q/k"), Self.bytes("beside"))
        try await client.put(Self.bytes("/tb/p/k1000"), Self.bytes("again"))
        try await eventually("the watch has brought the change under the prefix") { seen.withLock { $0 } == ["/tb/p/k1000"] }
        #expect(try await end == .expired && seen.withLock { $0 } == ["/tb/p/k1000"])
        await cluster.stop()
    }

    @Test("a member that accepts and never answers (a stopped process behind a live kernel) is passed over within the request timeout: the watch runs on the next member")
    func silentMember() async throws {
        // A listener that never accepts: the kernel completes the handshake, nothing answers.
        let fd = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
        #expect(fd >= 0)
        defer { close(fd) }
        var address = sockaddr_in()
        address.sin_family = sa_family_t(AF_INET)
        address.sin_addr.s_addr = inet_addr("127.0.0.1")
        var length = socklen_t(MemoryLayout<sockaddr_in>.size)
        let bound = withUnsafeMutablePointer(to: &address) { pointer in
            pointer.withMemoryRebound(to: sockaddr.self, capacity: 1) { bind(fd, $0, length) == 0 && getsockname(fd, $0, &length) == 0 }
        }
        #expect(bound && listen(fd, 16) == 0)
        let silent = "http://127.0.0.1:\(UInt16(bigEndian: address.sin_port))"
        let cluster = try await EtcdCluster(members: 1, answers: etcdAnswers)
        let writer = EtcdClient(endpoints: cluster.clientURLs)
        let from = try await writer.put(Self.bytes("/tb/s/k"), Self.bytes("before")) + 1
        let client = EtcdClient(endpoints: [silent] + cluster.clientURLs, timeout: .seconds(1))
        let seen = Mutex<Int>(0)
        let started = ContinuousClock.now
        async let end = client.watch(prefix: Self.bytes("/tb/s/"), from: from, for: .seconds(6)) { events, _ in
            seen.withLock { $0 += events.count }
        }
        try await writer.put(Self.bytes("/tb/s/k"), Self.bytes("after"))
        try await eventually("the watch, on the next member, has brought the change", timeout: .seconds(30)) { seen.withLock { $0 } == 1 }
        // (Without the deadline the silent member holds the watch for its whole six seconds.)
        #expect(ContinuousClock.now - started < .seconds(5))
        #expect(try await end == .expired)
        await cluster.stop()
    }

    @Test("a key on a lease: kept alive it stays; revoked, it goes at once; left alone, it expires")
    func leases() async throws {
        let cluster = try await EtcdCluster(members: 3, answers: etcdAnswers)
        let client = EtcdClient(endpoints: cluster.clientURLs)
        let lease = try await client.grantLease(ttl: .seconds(2))
        #expect(lease.id != 0 && lease.ttl == .seconds(2))
        try await client.put(Self.bytes("/tb/held"), Self.bytes("x"), lease: lease.id)
        #expect(try await client.get(Self.bytes("/tb/held")).record?.lease == lease.id)
        #expect(try await client.keepAlive(lease: lease.id) == .seconds(2))
        try await client.revoke(lease: lease.id)
        #expect(try await client.get(Self.bytes("/tb/held")).record == nil, "revoking the lease deletes its keys")
        #expect(try await client.keepAlive(lease: lease.id) == nil, "a revoked lease cannot be renewed")
        try await client.revoke(lease: lease.id)   // twice: no error

        let short = try await client.grantLease(ttl: .seconds(1))
        try await client.put(Self.bytes("/tb/lapsing"), Self.bytes("y"), lease: short.id)
        try await eventually("the lease lapses and takes its key", timeout: .seconds(10)) {
            (try? await client.get(Self.bytes("/tb/lapsing")).record) == .some(nil)
        }
        await cluster.stop()
    }

    @Test("one member lost: still served through the others; quorum lost: unavailable, not a wrong answer")
    func memberLoss() async throws {
        let cluster = try await EtcdCluster(members: 3, answers: etcdAnswers)
        // The lost member first in the list: the client must go on to the next.
        let client = EtcdClient(endpoints: cluster.clientURLs, timeout: .milliseconds(700))
        try await client.put(Self.bytes("/tb/k"), Self.bytes("1"))
        cluster.kill(0)
        // If it was the leader, the others elect a new one first (about a second): then served.
        try await eventually("writes go through the two members left", timeout: .seconds(15)) {
            (try? await client.put(Self.bytes("/tb/k"), Self.bytes("2"))) != nil
        }
        #expect(try await client.get(Self.bytes("/tb/k")).record?.value == Self.bytes("2"))
        cluster.kill(1)
        do {
            _ = try await client.put(Self.bytes("/tb/k"), Self.bytes("3"))
            Issue.record("a write without quorum succeeded")
        } catch {
            #expect(error.kind == .unavailable, "\(error)")
        }
        await cluster.stop()
    }
}

/// Whether the etcd member at `url` answers a read.
@Sendable func etcdAnswers(_ url: String) async -> Bool {
    (try? await EtcdClient(endpoints: [url], timeout: .milliseconds(500)).get(Array("ready".utf8))) != nil
}

@Suite("etcd over TLS with client certificates")
struct EtcdTLSTests {
    @Test("CAFile= plus a client certificate: the client talks to an etcd that demands one; without the certificate, or trusting another CA, etcd is unavailable, never served in clear")
    func clientCertificates() async throws {
        let certificates = try await TestCertificates.make()
        defer { try? FileManager.default.removeItem(atPath: certificates) }
        let tls = TLSOptions(caFile: certificates + "/ca.pem", clientCertificate: certificates + "/client.pem",
                             clientKey: certificates + "/client.key")
        let cluster = try await EtcdCluster(members: 1, certificates: certificates) { url in
            (try? await EtcdClient(endpoints: [url], tls: tls, timeout: .seconds(1)).get(Array("ready".utf8))) != nil
        }
        do {
            let url = try #require(cluster.clientURLs.first)
            #expect(url.hasPrefix("https://"))
            let client = EtcdClient(endpoints: [url], tls: tls)
            try await client.put(Array("k".utf8), Array("v".utf8))
            #expect(try await client.get(Array("k".utf8)).record?.value == Array("v".utf8))

            let noCertificate = EtcdClient(endpoints: [url], tls: TLSOptions(caFile: certificates + "/ca.pem"), timeout: .seconds(2))
            await #expect(throws: EtcdError.self) { _ = try await noCertificate.get(Array("k".utf8)) }
            let otherCA = EtcdClient(endpoints: [url], tls: TLSOptions(caFile: certificates + "/other.pem", clientCertificate: certificates + "/client.pem",
                                                                      clientKey: certificates + "/client.key"), timeout: .seconds(2))
            do {
                _ = try await otherCA.get(Array("k".utf8))
                Issue.record("a server the CA did not sign was trusted")
            } catch {
                #expect(error.kind == .unavailable)
            }
        } catch {
            await cluster.stop()
            throw error
        }
        await cluster.stop()
    }
}
