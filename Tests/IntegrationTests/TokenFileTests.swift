#if canImport(Glibc)
import Glibc
#endif
import Foundation
import Testing
import TestSupport
import Varlink

/// Token files (issue 36): a session's current token kept in a file by the real daemon
/// (`[Output]`, `ctl delegate --file`). Tokens are compared by fingerprint only.
@Suite("Token files: a session's token in a file, replaced whole, never through a link", .serialized)
struct TokenFileTests {
    static let reader: UInt32 = Broker.workerUID
    static let stranger: UInt32 = Broker.workerUID + 1

    static let config = """
        [Session]
        Name=api
        Upstream=test
        RefreshLimitBurst=10000

        [Session]
        Name=other
        Upstream=test

        [Output]
        Name=batch
        Session=api
        Path=@DIR@/files/batch/token
        Readers=\(reader)

        [Output]
        Name=batch-json
        Session=api
        Path=@DIR@/files/json/token.json
        Format=json
        Mode=0640

        [Output]
        Name=batch-header
        Session=api
        Path=@DIR@/files/header/header
        Format=header

        [Output]
        Name=read-only
        Session=api
        Path=@DIR@/files/read-only/token
        Mode=0400

        """

    /// The file's content, read as `uid` (through setpriv and cat), or nil when it cannot be read.
    static func read(_ path: String, as uid: UInt32) async throws -> String? {
        let run = try Child("/usr/bin/setpriv", ["--reuid=\(uid)", "--regid=\(uid)", "--clear-groups", "/bin/cat", path], directory: "/")
        return await run.wait() == 0 ? run.stdout : nil
    }

    static func contents(_ path: String) -> String? { try? String(contentsOfFile: path, encoding: .utf8) }

    static func token(_ broker: Broker, _ session: String = "api") throws -> String {
        try #require(try broker.call("GetToken", ["session": .string(session)]).parameters["token"]?.stringValue)
    }

    /// Waits until the file at `path` holds `token` (bare format), or is gone when `token` is nil.
    static func waitForFile(_ path: String, holding token: String?, _ what: String, timeout: Duration = .seconds(20)) async throws {
        try await eventually(what, timeout: timeout) {
            let content = contents(path)
            guard let token else { return content == nil }
            return content.map { $0.contains(token) } ?? false
        }
    }

    @Test("an [Output] keeps its session's token in a file in each format, with its mode and ACL readers (a reader reads it, a stranger cannot); a logout erases it and the next login writes it anew; a reload that removes the section erases its file, one that adds a section writes")
    func outputs() async throws {
        try await withBroker(config: Self.config) { broker in
            let dir = broker.directory + "/files"
            let token = try Self.token(broker)
            try await Self.waitForFile(dir + "/batch/token", holding: token, "the bare token file")
            try await Self.waitForFile(dir + "/json/token.json", holding: token, "the JSON file")
            try await Self.waitForFile(dir + "/header/header", holding: token, "the header file")
            #expect(Self.contents(dir + "/batch/token") == token + "\n")
            #expect(Self.contents(dir + "/header/header") == "Authorization: Bearer " + token + "\n")
            let json = try #require(try JSONSerialization.jsonObject(with: Data(contentsOf: URL(fileURLWithPath: dir + "/json/token.json"))) as? [String: Any])
            #expect(fp(json["access_token"] as? String) == fp(token))
            #expect(json["token_type"] as? String == "Bearer" && (json["expires_at"] as? Int ?? 0) > Int(Date().timeIntervalSince1970))
            #expect(json["serial"] as? Int != nil)
            // Modes: 0600 with an ACL for the reader (its group class shows the mask, r), 0640 as asked.
            var info = stat()
            stat(dir + "/batch/token", &info)
            #expect(info.st_mode & 0o777 == 0o640 && info.st_uid == getuid(), "mode \(String(info.st_mode & 0o777, radix: 8))")
            stat(dir + "/json/token.json", &info)
            #expect(info.st_mode & 0o777 == 0o640)
            stat(dir + "/header/header", &info)
            #expect(info.st_mode & 0o777 == 0o600)
            // The reader (by its ACL entry) reads the bare file; a stranger reads none of them.
            #expect(fp(try await Self.read(dir + "/batch/token", as: Self.reader)?.trimmingCharacters(in: .newlines)) == fp(token))
            #expect(try await Self.read(dir + "/batch/token", as: Self.stranger) == nil)
            #expect(try await Self.read(dir + "/header/header", as: Self.reader) == nil, "Readers= of one output only")
            // No temporary file is left beside them.
            #expect(try FileManager.default.contentsOfDirectory(atPath: dir + "/batch") == ["token"])

            // A logout erases every file of the session before long; the next login writes them.
            let started = ContinuousClock.now
            #expect(try await broker.ctl(["logout", "api"]).code == 0)
            try await Self.waitForFile(dir + "/batch/token", holding: nil, "the file erased at the logout")
            let erased = ContinuousClock.now - started
            print("logout → token file erased: \(erased)")
            try await Self.waitForFile(dir + "/json/token.json", holding: nil, "the JSON file erased at the logout")
            try await Self.waitForFile(dir + "/read-only/token", holding: nil, "a file of mode 0400 erased at the logout too")
            #expect(try await broker.ctl(["login", "api", "--refresh-token-stdin"], stdin: "r2\n").code == 0)
            let next = try Self.token(broker)
            #expect(fp(next) != fp(token))
            try await Self.waitForFile(dir + "/batch/token", holding: next, "the file written after the login")

            // A reload without batch-header erases its file; one that adds an output writes it.
            let reduced = Self.config.replacingOccurrences(of: "[Output]\nName=batch-header\nSession=api\nPath=@DIR@/files/header/header\nFormat=header\n", with: "")
                .replacingOccurrences(of: "@DIR@", with: broker.directory)
                + "\n[Output]\nName=other\nSession=other\nPath=\(dir)/other/token\n"
            try reduced.write(toFile: broker.configPath, atomically: true, encoding: .utf8)
            #expect(try await broker.ctl(["reload"]).code == 0)
            try await Self.waitForFile(dir + "/header/header", holding: nil, "the removed output's file erased")
            try await Self.waitForFile(dir + "/other/token", holding: try Self.token(broker, "other"), "the added output's file")
            #expect(Self.contents(dir + "/batch/token") == next + "\n", "an unchanged output stays as it was")
            let listed = try await broker.ctl(["delegations"]).out
            #expect(listed.contains("batch-json") && listed.contains("config") && !listed.contains("batch-header"), "\(listed)")
            #expect(try await broker.ctl(["metrics"]).out.contains("tokenbroker_token_file_writes_total{result=\"ok\"}"))
        }
    }

    @Test("a file is replaced whole: reads in a loop across renewals see only complete, unexpired tokens the broker handed out, never a part, and no file is ever missing while the session is logged in")
    func atomicRenewals() async throws {
        let renewals = Int(ProcessInfo.processInfo.environment["TB_FILE_RENEWALS"] ?? "") ?? 100
        let reads = Int(ProcessInfo.processInfo.environment["TB_FILE_READS"] ?? "") ?? 10_000
        try await withBroker(config: Self.config) { broker in
            let path = broker.directory + "/files/json/token.json"
            let first = try Self.token(broker)
            try await Self.waitForFile(path, holding: first, "the first token in the file")
            let handedOut = Locked<Set<String>>([fp(first)])
            let renewing = Locked(true)
            // The reader: a thread of its own, reading the whole file each time, as a batch job would.
            let report: (reads: Int, bad: [String], seen: Set<String>) = await withCheckedContinuation { continuation in
                let thread = Thread {
                    var (count, bad, seen) = (0, [String](), Set<String>())
                    while renewing.value || count < reads {
                        count += 1
                        guard let data = FileManager.default.contents(atPath: path) else {
                            bad.append("read \(count): no file")
                            continue
                        }
                        guard let object = try? JSONSerialization.jsonObject(with: data) as? [String: Any],
                              let token = object["access_token"] as? String, let expiresAt = object["expires_at"] as? Int else {
                            bad.append("read \(count): \(data.count) bytes, not a whole token")
                            continue
                        }
                        if expiresAt <= Int(Date().timeIntervalSince1970) { bad.append("read \(count): an expired token") }
                        seen.insert(fp(token))
                        if bad.count > 20 { break }
                    }
                    continuation.resume(returning: (count, bad, seen))
                }
                thread.start()
                Task {
                    defer { renewing.withLock { $0 = false } }
                    for _ in 0..<renewals {
                        let reply = try? broker.call("Refresh", ["session": "api"])
                        guard let reply, reply.error == nil, let token = try? Self.token(broker) else {
                            Issue.record("Refresh failed: \(reply?.error ?? "no reply")")
                            return
                        }
                        handedOut.withLock { _ = $0.insert(fp(token)) }
                        try? await Self.waitForFile(path, holding: token, "the renewed token in the file")
                    }
                }
            }
            #expect(report.bad.isEmpty, "\(report.bad.prefix(5))")
            #expect(report.reads >= reads)
            let unknown = report.seen.subtracting(handedOut.withLock { $0 })
            #expect(unknown.isEmpty, "tokens in the file the broker never handed out: \(unknown)")
            #expect(report.seen.count > 1, "the reader saw the renewals")
            print("token file: \(report.reads) reads across \(renewals) renewals, \(report.seen.count) tokens seen")
        }
    }

    @Test("never through a symlink nor into a directory others can write: ctl delegate --file refuses with the reason; a configured output says why in ctl delegations, writes nothing through the link, and writes once the link is gone")
    func unsafePaths() async throws {
        let directory = try Paths.temporaryDirectory()
        chmod(directory, 0o755)
        try FileManager.default.createDirectory(atPath: directory + "/files/batch", withIntermediateDirectories: true)
        let victim = directory + "/victim"
        try "precious\n".write(toFile: victim, atomically: true, encoding: .utf8)
        try FileManager.default.createSymbolicLink(atPath: directory + "/files/batch/token", withDestinationPath: victim)
        let config = Self.config.replacingOccurrences(of: "@DIR@/files/", with: directory + "/files/")
        try await withBroker(config: config) { broker in
            let listed = try await broker.ctl(["delegations"])
            #expect(listed.out.contains("batch: \(directory)/files/batch/token is a symlink: refusing to write a token through or over it"), "\(listed.out)")
            // At run time: refused at once, with the reason.
            let linked = try await broker.ctl(["delegate", "api", "--file", directory + "/files/batch/token", "--name", "linked"])
            #expect(linked.code == 1 && linked.err.contains("is a symlink"), "\(linked.err)")
            try FileManager.default.createDirectory(atPath: directory + "/open", withIntermediateDirectories: true)
            chmod(directory + "/open", 0o777)
            // A symlink on the way to the file's directory is refused: re-pointed, it would move the file.
            try FileManager.default.createSymbolicLink(atPath: directory + "/link", withDestinationPath: directory + "/files")
            let through = try await broker.ctl(["delegate", "api", "--file", directory + "/link/batch/other", "--name", "through"])
            #expect(through.code == 1 && through.err.contains("a symlink on the way"), "\(through.err)")
            let open = try await broker.ctl(["delegate", "api", "--file", directory + "/open/token", "--name", "open"])
            #expect(open.code == 1 && open.err.contains("writable by everyone"), "\(open.err)")
            chmod(directory + "/open", 0o775)
            chown(directory + "/open", 0, 1)
            let group = try await broker.ctl(["delegate", "api", "--file", directory + "/open/token", "--name", "open"])
            #expect(group.code == 1 && group.err.contains("writable by group"), "\(group.err)")
            let format = try await broker.ctl(["delegate", "api", "--file", directory + "/open/token", "--format", "nonsense"])
            #expect(format.code == 64, "\(format.err)")
            #expect(try await broker.ctl(["delegate", "api", "other", "--file", directory + "/files/two"]).code == 64, "one session per file")
            // Refreshes write nothing through the link.
            _ = try broker.call("Refresh", ["session": "api"])
            try await Self.waitForFile(directory + "/files/json/token.json", holding: try Self.token(broker), "the other outputs renewed")
            #expect(Self.contents(victim) == "precious\n", "the link's target is untouched")
            // Once the link is gone, the next token is written.
            unlink(directory + "/files/batch/token")
            _ = try broker.call("Refresh", ["session": "api"])
            try await Self.waitForFile(directory + "/files/batch/token", holding: try Self.token(broker), "the file written once the link is gone")
            #expect(try await broker.ctl(["delegations"]).out.contains("symlink") == false, "the problem is gone with the link")
        }
        try? FileManager.default.removeItem(atPath: directory)
    }

    @Test("ctl delegate --file keeps a token file for as long as the delegation lasts: the token is in it when ctl returns; undelegate erases it before it returns, --ttl ends it by itself; a socket and a file in one delegation; no file writable by others, none in the daemon's own state")
    func delegatedFiles() async throws {
        try await withBroker(config: Self.config) { broker in
            let path = broker.directory + "/files/ci/token"
            let made = try await broker.ctl(["delegate", "api", "--file", path, "--format", "header", "--readers", "\(Self.reader)", "--name", "ci",
                                             "--socket", broker.directory + "/files/ci.sock", "--mode", "0666", "--file-mode", "0640"])
            #expect(made.code == 0 && made.out.contains("in \(path)") && made.out.contains("on \(broker.directory)/files/ci.sock"), "\(made.err)")
            let token = try Self.token(broker)
            #expect(Self.contents(path) == "Authorization: Bearer \(token)\n", "written before ctl delegate returned")
            #expect(try await Self.read(path, as: Self.reader) == "Authorization: Bearer \(token)\n")
            var info = stat()
            stat(path, &info)
            #expect(info.st_mode & 0o777 == 0o640)
            stat(broker.directory + "/files/ci.sock", &info)
            #expect(info.st_mode & 0o777 == 0o666, "--mode is the socket's alone")
            for mode in ["0660", "0646", "0700"] {
                #expect(try await broker.ctl(["delegate", "api", "--file", path + "2", "--file-mode", mode]).code == 64, "--file-mode \(mode)")
            }
            let state = try await broker.ctl(["delegate", "api", "--file", broker.directory + "/state/state.db", "--name", "state"])
            #expect(state.code == 1 && state.err.contains("the daemon's own files are never replaced by a token file"), "\(state.err)")
            #expect(try await broker.ctl(["undelegate", "ci"]).code == 0)
            #expect(Self.contents(path) == nil, "erased before undelegate returned")
            #expect(access(broker.directory + "/files/ci.sock", F_OK) != 0)
            // A ttl: the file is erased when it ends.
            #expect(try await broker.ctl(["delegate", "api", "--file", path, "--name", "short", "--ttl", "1s"]).code == 0)
            try await Self.waitForFile(path, holding: token, "the short delegation's file")
            try await Self.waitForFile(path, holding: nil, "the file erased at the ttl")
            #expect(try await broker.ctl(["delegations"]).out.contains("short") == false)
        }
    }

    @Test("a real container (systemd-nspawn) that binds the file's directory reads each new token; one that binds the file itself keeps the old content after the host renames a new file over it")
    func realContainer() async throws {
        guard ContainerRoot.nspawnAvailable() else { return }
        try await withBroker(config: Self.config) { broker in
            let directory = broker.directory + "/files/batch"
            let first = try Self.token(broker)
            try await Self.waitForFile(directory + "/token", holding: first, "the file")
            let root = broker.directory + "/root"
            try ContainerRoot.make(at: root, directories: ["out", "dir", "file"])
            _ = FileManager.default.createFile(atPath: root + "/file/token", contents: Data())
            // Inside: read both, say so, wait (bounded) for the host's go, read both again.
            let script = """
                cat /dir/token > /out/dir1; cat /file/token > /out/file1; touch /out/first
                i=0; while [ ! -e /out/go ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done
                cat /dir/token > /out/dir2; cat /file/token > /out/file2
                """
            let run = try Child("/usr/bin/systemd-nspawn", ["-q", "-D", root, "--bind-ro=/usr", "--register=no", "--keep-unit", "--console=pipe",
                                                          "--bind-ro=\(directory):/dir", "--bind-ro=\(directory)/token:/file/token",
                                                          "--bind=\(root)/out:/out", "/bin/sh", "-c", script], directory: broker.directory)
            try await eventually("the container's first reads") { access(root + "/out/first", F_OK) == 0 || !run.process.isRunning }
            _ = try broker.call("Refresh", ["session": "api"])
            let second = try Self.token(broker)
            try await Self.waitForFile(directory + "/token", holding: second, "the renewed file")
            _ = FileManager.default.createFile(atPath: root + "/out/go", contents: Data())
            #expect(await run.wait(timeout: 120) == 0, "\(run.stderr.suffix(400))")
            func inside(_ name: String) -> String { fp(Self.contents(root + "/out/" + name)?.trimmingCharacters(in: .newlines)) }
            #expect(inside("dir1") == fp(first) && inside("file1") == fp(first))
            #expect(inside("dir2") == fp(second), "the directory bind sees the new file")
            #expect(inside("file2") == fp(first), "a file bind keeps the old inode: bind the directory")
        }
    }
}
