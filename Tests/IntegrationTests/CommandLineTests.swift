import Foundation
import Testing
import TestSupport

/// Runs the real `tokenbroker` binary (built with the tests, it sits next to the test bundle).
func run(_ arguments: String...) async throws -> (code: Int32, stdout: String, stderr: String) {
    try await Child.run(Paths.tokenbroker, arguments)
}

@Suite("tokenbroker command line")
struct CommandLineTests {
    @Test("-h, --help and help print the same help, with every section, and exit 0")
    func help() async throws {
        let runs = [try await run("-h"), try await run("--help"), try await run("help")]
        for run in runs {
            #expect(run.code == 0)
            #expect(run.stdout == runs[0].stdout)
            #expect(run.stderr.isEmpty)
        }
        for section in ["OVERVIEW:", "USAGE: tokenbroker", "OPTIONS:", "SUBCOMMANDS:"] {
            #expect(runs[0].stdout.contains(section), "missing \(section)")
        }
    }

    @Test("--version prints the name and a semantic version")
    func version() async throws {
        let version = try await run("--version")
        #expect(version.code == 0)
        #expect(version.stdout.wholeMatch(of: /tokenbroker \d+\.\d+\.\d+\n/) != nil)
    }

    @Test("bad usage: `Error: …` and the usage on stderr, exit 64", arguments: [[], ["frobnicate"], ["--nope"]])
    func usage(arguments: [String]) async throws {
        let result = try await Child.run(Paths.tokenbroker, arguments)
        #expect(result.code == 64)
        #expect(result.stderr.hasPrefix("Error: "))
        #expect(result.stderr.contains("USAGE: tokenbroker"))
    }

    @Test("tokenbroker is one static executable: no program interpreter, so no dynamic loader and no shared library to map")
    func staticExecutable() throws {
        let image = try ELFImage(path: Paths.tokenbroker)
        #expect(!image.segmentTypes.isEmpty)
        #expect(!image.segmentTypes.contains(ELFImage.interpreter), "PT_INTERP: the executable asks for a dynamic loader")
        #expect(!image.segmentTypes.contains(ELFImage.dynamic), "PT_DYNAMIC: the executable has dynamic linking information")
    }

    @Test("tokenbroker-daemon links SQLite, and opens libcurl, libcrypto and libsystemd when it needs them rather than at exec")
    func daemonLibraries() throws {
        let needed = try ELFImage(path: Paths.daemon).neededLibraries()
        #expect(needed.contains("libsqlite3.so.0"), "\(needed)")
        for opened in ["libcurl", "libcrypto", "libssl", "libsystemd"] {
            #expect(!needed.contains(where: { $0.hasPrefix(opened) }), "\(opened): \(needed)")
        }
    }

    @Test("relative --config, --socket and --state-dir mean relative to the working directory, for serve and ctl alike")
    func relativePaths() async throws {
        let root = try Paths.temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: root) }
        try Broker.defaultConfig.write(toFile: root + "/tb.conf", atomically: true, encoding: .utf8)
        let server = try Child(Paths.tokenbroker, ["serve", "--config", "tb.conf", "--socket", "tb.sock", "--state-dir", "state"],
                               directory: root, workingDirectory: root)
        try await waitForSocket(root + "/tb.sock", server: server)
        #expect(FileManager.default.fileExists(atPath: root + "/state/state.db"))
        let status = try await Child.run(Paths.tokenbroker, ["ctl", "--socket", "tb.sock", "status"], workingDirectory: root)
        #expect(status.code == 0, "\(status.stderr)")
        #expect(server.stderr.contains("listening on \(root)/tb.sock"), "the daemon names the absolute path: \(server.stderr)")
        kill(server.process.processIdentifier, SIGTERM)
        #expect(await server.wait() == 0)
    }

    @Test("installed layout: bin/tokenbroker runs ../libexec/tokenbroker/tokenbroker-daemon for check-config and serve; without it, says so and exits 1; ctl needs no daemon executable")
    func daemonExecutable() async throws {
        let root = try Paths.temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: root) }
        let files = FileManager.default
        try files.createDirectory(atPath: root + "/bin", withIntermediateDirectories: true)
        try files.copyItem(atPath: Paths.tokenbroker, toPath: root + "/bin/tokenbroker")
        let config = Paths.packageRoot.appendingPathComponent("config/tokenbroker.conf").path

        // (Unless this machine has one installed where the package or `make install` put it.)
        let installed = ["/usr/libexec/tokenbroker/tokenbroker-daemon", "/usr/local/libexec/tokenbroker/tokenbroker-daemon"]
        if !installed.contains(where: { FileManager.default.isExecutableFile(atPath: $0) }) {
            let missing = try await Child.run(root + "/bin/tokenbroker", ["check-config", "--config", config])
            #expect(missing.code == 1)
            #expect(missing.stderr.contains("cannot find tokenbroker-daemon"), "\(missing.stderr)")
            let serve = try await Child.run(root + "/bin/tokenbroker", ["serve", "--socket", root + "/s"])
            #expect(serve.code == 1 && serve.stderr.contains("cannot find tokenbroker-daemon"))
        }
        // ctl is the command's own: no daemon executable, no daemon, exit 69 (unavailable).
        let ctl = try await Child.run(root + "/bin/tokenbroker", ["ctl", "--socket", root + "/none", "status"])
        #expect(ctl.code == 69, "\(ctl.code): \(ctl.stderr)")

        try files.createDirectory(atPath: root + "/libexec/tokenbroker", withIntermediateDirectories: true)
        try files.copyItem(atPath: Paths.daemon, toPath: root + "/libexec/tokenbroker/tokenbroker-daemon")
        let check = try await Child.run(root + "/bin/tokenbroker", ["check-config", "--config", config])
        #expect(check.code == 0, "\(check.stderr)")
        #expect(check.stdout.hasPrefix(config + ": OK, "), "\(check.stdout)")
    }
}

/// Just enough of an ELF64 little-endian file to see how it is linked.
struct ELFImage {
    static let dynamic = 2, interpreter = 3, load = 1
    let bytes: [UInt8]
    /// (type, file offset, virtual address, file size) of each program header.
    let segments: [(type: Int, offset: Int, address: Int, size: Int)]
    var segmentTypes: [Int] { segments.map(\.type) }

    init(path: String) throws {
        let bytes = Array(try Data(contentsOf: URL(fileURLWithPath: path)))
        self.bytes = bytes
        guard bytes.count > 64, bytes.prefix(4).elementsEqual([0x7f, 0x45, 0x4c, 0x46]), bytes[4] == 2, bytes[5] == 1 else {
            throw POSIXError(.ENOEXEC)
        }
        let (table, entrySize, count) = (Self.integer(bytes, 0x20, 8), Self.integer(bytes, 0x36, 2), Self.integer(bytes, 0x38, 2))
        guard entrySize >= 56, table + entrySize * count <= bytes.count else { throw POSIXError(.ENOEXEC) }
        segments = (0..<count).map { index in
            let base = table + index * entrySize
            return (Self.integer(bytes, base, 4), Self.integer(bytes, base + 8, 8), Self.integer(bytes, base + 16, 8), Self.integer(bytes, base + 32, 8))
        }
    }

    static func integer(_ bytes: [UInt8], _ offset: Int, _ size: Int) -> Int {
        (0..<size).reduce(0) { $0 | Int(bytes[offset + $1]) << (8 * $1) }
    }

    /// The DT_NEEDED entries: the shared libraries the loader maps before main.
    func neededLibraries() throws -> [String] {
        guard let dynamic = segments.first(where: { $0.type == Self.dynamic }) else { return [] }
        var entries: [(tag: Int, value: Int)] = []
        for offset in stride(from: dynamic.offset, to: dynamic.offset + dynamic.size, by: 16) {
            let tag = Self.integer(bytes, offset, 8)
            if tag == 0 { break }
            entries.append((tag, Self.integer(bytes, offset + 8, 8)))
        }
        // DT_STRTAB (5) is an address: find the loaded segment that holds it.
        guard let table = entries.first(where: { $0.tag == 5 })?.value,
              let segment = segments.first(where: { $0.type == Self.load && (($0.address)..<($0.address + $0.size)).contains(table) })
        else { throw POSIXError(.ENOEXEC) }
        let strings = table - segment.address + segment.offset
        return entries.filter { $0.tag == 1 }.map { entry in
            let start = strings + entry.value
            let end = bytes[start...].firstIndex(of: 0) ?? bytes.endIndex
            return String(decoding: bytes[start..<end], as: UTF8.self)
        }
    }
}
